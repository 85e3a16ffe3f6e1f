package kvpool

import "fmt"

// tokenSlots calls f with the slot of every token of [from, to) in every buffer of p, where
// pages lists the session's pages in token order (page i holds tokens [i×PageSize, (i+1)×PageSize)).
func tokenSlots(p Buffers, pages []int64, from, to int64, f func(slot []byte, token int64, buffer int)) error {
	l := p.Layout()
	if l.PageSize <= 0 || l.ItemLen == 0 {
		return fmt.Errorf("%w: layout %+v", ErrBadSpec, l)
	}
	ps := int64(l.PageSize)
	tb := l.TokenBytes()
	if from < 0 || to < from {
		return fmt.Errorf("%w: token range [%d, %d)", ErrBadSpec, from, to)
	}
	if to == from {
		return nil
	}
	if (to-1)/ps >= int64(len(pages)) {
		return fmt.Errorf("%w: %d pages do not cover %d tokens", ErrBadSpec, len(pages), to)
	}
	for i := from / ps; i <= (to-1)/ps; i++ {
		if pages[i] < 0 || pages[i] >= l.PageCount {
			return fmt.Errorf("%w: page %d outside [0, %d)", ErrBadSpec, pages[i], l.PageCount)
		}
	}
	nb := l.NumBuffers()
	for b := 0; b < nb; b++ {
		buf := p.Buffer(b)
		for t := from; t < to; t++ {
			off := uint64(pages[t/ps])*l.ItemLen + uint64(t%ps)*tb
			f(buf[off:off+tb:off+tb], t, b)
		}
	}
	return nil
}

// FillTokens writes the known bytes of tokens [from, to) of the session with seed into every
// buffer of p (see FillToken).
func FillTokens(p Buffers, seed uint64, pages []int64, from, to int64) error {
	return tokenSlots(p, pages, from, to, func(slot []byte, token int64, buffer int) {
		FillToken(slot, seed, token, buffer)
	})
}

// CheckTokens counts the (token, buffer) slots of [from, to) that do not hold the session's known
// bytes; 0 means every byte verified. The error reports bad arguments, not mismatches.
func CheckTokens(p Buffers, seed uint64, pages []int64, from, to int64) (mismatches int64, err error) {
	err = tokenSlots(p, pages, from, to, func(slot []byte, token int64, buffer int) {
		if !CheckToken(slot, seed, token, buffer) {
			mismatches++
		}
	})
	return mismatches, err
}
