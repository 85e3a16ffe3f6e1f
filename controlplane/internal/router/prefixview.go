package router

import "container/list"

// prefixViewPages bounds what the router remembers per prefill worker (SGLang's router bounds
// its approximate trees by --max-tree-size the same way): least recently routed pages go first.
const prefixViewPages = 1 << 16

// prefixView is the router's approximate picture of one prefill worker's prefix cache: the
// page hashes (chained: each covers the whole prefix before it) of the prompts it routed there,
// LRU-bounded. It is what a cache-aware router keeps (policy.PrefixView); guarded by
// Service.mu like the rest of the ledger.
type prefixView struct {
	lru *list.List
	idx map[uint64]*list.Element
}

func (v *prefixView) insert(prompt []uint64) {
	for i := len(prompt) - 1; i >= 0; i-- { // deepest first: the root ends most recently used
		if e, ok := v.idx[prompt[i]]; ok {
			v.lru.MoveToFront(e)
			continue
		}
		v.idx[prompt[i]] = v.lru.PushFront(prompt[i])
	}
	for v.lru.Len() > prefixViewPages {
		e := v.lru.Back()
		delete(v.idx, e.Value.(uint64))
		v.lru.Remove(e)
	}
}

// PrefillPrefix implements policy.PrefixView.
func (l *ledger) PrefillPrefix(id string, prompt []uint64) int {
	v := l.prefix[id]
	if v == nil {
		return 0
	}
	n := 0
	for n < len(prompt) {
		if _, ok := v.idx[prompt[n]]; !ok {
			break
		}
		n++
	}
	return n
}

// routedPrompt records that prompt was routed to prefill worker id.
func (l *ledger) routedPrompt(id string, prompt []uint64) {
	if id == "" || len(prompt) == 0 {
		return
	}
	if l.prefix == nil {
		l.prefix = map[string]*prefixView{}
	}
	v := l.prefix[id]
	if v == nil {
		v = &prefixView{lru: list.New(), idx: map[uint64]*list.Element{}}
		l.prefix[id] = v
	}
	v.insert(prompt)
}
