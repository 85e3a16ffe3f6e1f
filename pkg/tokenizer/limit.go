package tokenizer

import (
	"context"
	"fmt"
)

// TokenLimitError is what the Context encoders return when the ids would pass their bound.
type TokenLimitError struct {
	Limit int // the bound (MaxTokens)
}

func (e *TokenLimitError) Error() string {
	return fmt.Sprintf("tokenizer: more than %d tokens", e.Limit)
}

// Limit bounds one encoding (EncodeContext, EncodeReuseContext): it stops when Ctx is done
// (checked every checkEvery pieces, and every checkEveryPops merges inside one long piece) or
// once the ids pass MaxTokens (checked after every piece).
type Limit struct {
	Ctx       context.Context // nil: never cancelled
	MaxTokens int             // <= 0: unbounded
}

// How often an encoding under a Limit looks at its context: every checkEvery pre-tokenized
// pieces (a few microseconds of work), and every checkEveryPops heap pops of one piece's
// merges (a piece of megabytes without a split: a run of letters).
const (
	checkEvery     = 256
	checkEveryPops = 1 << 14
)

// limiter is a Limit in use (encodeScratch.lim; nil: none).
type limiter struct {
	Limit
	n   int   // pieces or pops since the last context check
	err error // the reason the encoding stopped
}

// stop reports whether the encoding must stop, with dst holding n ids (nil receiver: never).
func (l *limiter) stop(n int) bool {
	if l == nil {
		return false
	}
	if l.err != nil {
		return true
	}
	if l.MaxTokens > 0 && n > l.MaxTokens {
		l.err = &TokenLimitError{Limit: l.MaxTokens}
		return true
	}
	l.n++
	if l.n >= checkEvery && l.Ctx != nil {
		l.n = 0
		if err := l.Ctx.Err(); err != nil {
			l.err = context.Cause(l.Ctx)
			return true
		}
	}
	return false
}

// stopPops is stop's check inside one piece's merges: the context only.
func (l *limiter) stopPops(pops int) bool {
	if l == nil || l.Ctx == nil || pops%checkEveryPops != 0 {
		return l != nil && l.err != nil
	}
	if l.Ctx.Err() != nil {
		l.err = context.Cause(l.Ctx)
	}
	return l.err != nil
}

// EncodeContext is Encode under lim: it returns the ids, or nil and the context's error or a
// *TokenLimitError when it stopped.
func (t *Tokenizer) EncodeContext(lim Limit, text string, addSpecial bool) ([]uint32, error) {
	sc := scratchPool.Get().(*encodeScratch)
	l := &limiter{Limit: lim}
	sc.lim, sc.bpe.lim = l, l
	ids := t.appendEncode(make([]uint32, 0, min(len(text)/3+4, 1<<16)), text, addSpecial, sc)
	sc.lim, sc.bpe.lim = nil, nil
	putScratch(sc)
	if l.err == nil {
		l.stop(len(ids)) // the post-processor's suffix
	}
	if l.err != nil {
		return nil, l.err
	}
	return ids, nil
}

// EncodeReuseContext is EncodeReuse under lim (the ids reused count toward MaxTokens).
func (t *Tokenizer) EncodeReuseContext(lim Limit, text string, prev *Encoded) (*Encoded, int, error) {
	l := &limiter{Limit: lim}
	enc, reuse := t.encodeReuse(text, prev, l)
	if l.err == nil {
		l.stop(len(enc.IDs))
	}
	if l.err != nil {
		return nil, 0, l.err
	}
	return enc, reuse, nil
}

// maxPooledScratch is the largest buffer (elements) a scratch keeps when it goes back to the
// pool: a huge input's buffers are dropped, so its memory returns to the runtime.
const maxPooledScratch = 1 << 16

// putScratch returns sc to the pool without its buffers that grew past maxPooledScratch.
func putScratch(sc *encodeScratch) {
	if cap(sc.segs) > maxPooledScratch {
		sc.segs = nil
	}
	if cap(sc.segs2) > maxPooledScratch {
		sc.segs2 = nil
	}
	if cap(sc.pieces) > maxPooledScratch {
		sc.pieces = nil
	}
	if cap(sc.tmp) > maxPooledScratch {
		sc.tmp = nil
	}
	if cap(sc.ids) > maxPooledScratch {
		sc.ids = nil
	}
	b := &sc.bpe
	if cap(b.syms) > maxPooledScratch || cap(b.heap) > maxPooledScratch {
		*b = scratch{}
	}
	scratchPool.Put(sc)
}
