package server

import (
	"container/list"
	"sync"

	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// DefaultTokenizeCacheBytes bounds the cache when nothing else does: 64 MiB holds the last
// rendered prompt, ids and messages of ~150 sessions at 32K tokens (~420 KB each: text and ids
// ~260 KB, the messages up to the last user message ~160 KB), of thousands at 2K.
const DefaultTokenizeCacheBytes = 64 << 20

// tokCache keeps, per session, the last chat prompt the gateway rendered and encoded
// (tokenizer.Encoded: text, ids and the cuts where encoding is concatenative) and its
// tokenizer.ChatRender (the messages up to the last user message and where their rendering ends
// in the text), so the next turn — the same conversation plus a few messages — renders only the
// messages from that user message on and encodes only what follows the longest cut the two
// renderings share byte for byte (docs/tokenization.md). An LRU bounded by bytes; safe for
// concurrent use. A nil *tokCache is off.
type tokCache struct {
	mu    sync.Mutex
	max   int64
	used  int64
	order *list.List // of *tokEntry, most recent first
	byKey map[string]*list.Element
}

type tokEntry struct {
	key  string
	enc  *tokenizer.Encoded
	chat *tokenizer.ChatRender // nil: not a chat prompt
}

// size is what an entry holds: the encoding (its text is the ChatRender's too) and the messages.
func (e *tokEntry) size() int64 { return e.enc.Size() + e.chat.Size() + int64(len(e.key)) }

// newTokCache returns a cache bounded by maxBytes, or nil (off) when maxBytes <= 0.
func newTokCache(maxBytes int64) *tokCache {
	if maxBytes <= 0 {
		return nil
	}
	return &tokCache{max: maxBytes, order: list.New(), byKey: map[string]*list.Element{}}
}

// tokCacheBytes is the cache bound: the Content's when set (negative = off), else the default.
// The gateway's --tokenize-cache-bytes sets it (0 there is off).
func tokCacheBytes(configured int64) int64 {
	if configured != 0 {
		return configured
	}
	return DefaultTokenizeCacheBytes
}

// get returns the session's last encoding, or nil.
func (c *tokCache) get(key string) *tokenizer.Encoded {
	enc, _ := c.getTurn(key)
	return enc
}

// getTurn returns the session's last encoding and chat rendering (nil, nil when none).
func (c *tokCache) getTurn(key string) (*tokenizer.Encoded, *tokenizer.ChatRender) {
	if c == nil || key == "" {
		return nil, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[key]
	if !ok {
		return nil, nil
	}
	c.order.MoveToFront(el)
	e := el.Value.(*tokEntry)
	return e.enc, e.chat
}

// put makes enc the session's last encoding (no chat rendering).
func (c *tokCache) put(key string, enc *tokenizer.Encoded) { c.putTurn(key, enc, nil) }

// putTurn makes enc and chat (nil: none) the session's last turn and evicts the least
// recently used sessions while the cache is over its bound. A turn larger than the bound is
// not kept.
func (c *tokCache) putTurn(key string, enc *tokenizer.Encoded, chat *tokenizer.ChatRender) {
	if c == nil || key == "" || enc == nil {
		return
	}
	ne := &tokEntry{key: key, enc: enc, chat: chat}
	size := ne.size()
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.byKey[key]; ok {
		c.used -= el.Value.(*tokEntry).size()
		c.order.Remove(el)
		delete(c.byKey, key)
	}
	if size > c.max {
		return
	}
	c.byKey[key] = c.order.PushFront(ne)
	c.used += size
	for c.used > c.max {
		el := c.order.Back()
		e := el.Value.(*tokEntry)
		c.used -= e.size()
		c.order.Remove(el)
		delete(c.byKey, e.key)
	}
}

// stats is the number of sessions kept and the bytes they hold.
func (c *tokCache) stats() (sessions int, bytes int64) {
	if c == nil {
		return 0, 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.byKey), c.used
}
