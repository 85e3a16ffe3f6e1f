package server

import (
	"container/list"
	"strconv"
	"sync"

	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// TokenizeCacheEnv names the environment variable that bounds the incremental tokenization
// cache, in bytes (0 = off); unset, DefaultTokenizeCacheBytes.
const TokenizeCacheEnv = "KVC_GATEWAY_TOKENIZE_CACHE_BYTES"

// DefaultTokenizeCacheBytes bounds the cache when nothing else does: 64 MiB holds the last
// rendered prompt and ids of ~250 sessions at 32K tokens (~260 KB each), of thousands at 2K.
const DefaultTokenizeCacheBytes = 64 << 20

// tokCache keeps, per session, the last chat prompt the gateway rendered and encoded
// (tokenizer.Encoded: text, ids and the cuts where encoding is concatenative), so the next turn
// — the same conversation plus a few messages — encodes only what follows the longest cut the
// two renderings share byte for byte (docs/tokenization.md). An LRU bounded by bytes; safe for
// concurrent use. A nil *tokCache is off.
type tokCache struct {
	mu    sync.Mutex
	max   int64
	used  int64
	order *list.List // of *tokEntry, most recent first
	byKey map[string]*list.Element
}

type tokEntry struct {
	key string
	enc *tokenizer.Encoded
}

// newTokCache returns a cache bounded by maxBytes, or nil (off) when maxBytes <= 0.
func newTokCache(maxBytes int64) *tokCache {
	if maxBytes <= 0 {
		return nil
	}
	return &tokCache{max: maxBytes, order: list.New(), byKey: map[string]*list.Element{}}
}

// tokCacheBytes is the cache bound: the Content's when set (negative = off), else the
// environment's (TokenizeCacheEnv), else the default.
func tokCacheBytes(configured int64, getenv func(string) string) int64 {
	if configured != 0 {
		return configured
	}
	if v := getenv(TokenizeCacheEnv); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return -1 // a bad value turns the cache off rather than guessing (logged by the caller)
		}
		return n
	}
	return DefaultTokenizeCacheBytes
}

// get returns the session's last encoding, or nil.
func (c *tokCache) get(key string) *tokenizer.Encoded {
	if c == nil || key == "" {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.byKey[key]
	if !ok {
		return nil
	}
	c.order.MoveToFront(el)
	return el.Value.(*tokEntry).enc
}

// put makes enc the session's last encoding and evicts the least recently used sessions
// while the cache is over its bound. An encoding larger than the bound is not kept.
func (c *tokCache) put(key string, enc *tokenizer.Encoded) {
	if c == nil || key == "" || enc == nil {
		return
	}
	size := enc.Size() + int64(len(key))
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.byKey[key]; ok {
		e := el.Value.(*tokEntry)
		c.used -= e.enc.Size() + int64(len(key))
		c.order.Remove(el)
		delete(c.byKey, key)
	}
	if size > c.max {
		return
	}
	c.byKey[key] = c.order.PushFront(&tokEntry{key: key, enc: enc})
	c.used += size
	for c.used > c.max {
		el := c.order.Back()
		e := el.Value.(*tokEntry)
		c.used -= e.enc.Size() + int64(len(e.key))
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
