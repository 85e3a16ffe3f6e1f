package store

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// Guard geometry: 4 tokens a page, 8 bytes a token per buffer, 2 buffers (1 layer).
const gPS, gTB, gItem = 4, 8, 4 * 8

var gBufs = []uint64{0x100000, 0x200000}

// gAddr is the address of token tok (within its page) of page pg in buffer b.
func gAddr(b int, pg, tok int64) uint64 { return gBufs[b] + uint64(pg*gItem+tok*gTB) }

func newGuardedStore(t *testing.T, now func() time.Time) *Store {
	t.Helper()
	s, err := New(Config{PageSize: gPS, PageBytes: int64(len(gBufs)) * gItem, PageCount: 16, Buffers: gBufs, Now: now, ReserveTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestWriteGuard(t *testing.T) {
	clock := time.Unix(1000, 0)
	s := newGuardedStore(t, func() time.Time { return clock })
	// a: tokens [0, 6) committed (pages 0, 1), then an append of [6, 11) in flight: the tail of
	// page 1 (tokens 2..3 of it) and a new page for tokens [8, 11).
	_, va := mustIngest(t, s, "a", 1, 0, 6)
	ra, err := s.Reserve("a", 1, 6, 5, "d0")
	if err != nil {
		t.Fatal(err)
	}
	tail, next := va.Pages[1], ra.Pages[1]
	// b: a full push of [0, 4) in flight; c: committed, nothing in flight.
	rb, err := s.Reserve("b", 1, 0, 4, "d1")
	if err != nil {
		t.Fatal(err)
	}
	_, vc := mustIngest(t, s, "c", 1, 0, 8)
	pb := rb.Pages[0]
	free := int64(15)

	tests := []struct {
		name      string
		peer      string
		addr, n   uint64
		refuse    string // "" allowed, else part of the error
		afterward func()
	}{
		{"append tail by its pusher", "A", gAddr(0, tail, 2), 2 * gTB, "", nil},
		{"append new page, buffer 1", "A", gAddr(1, next, 0), 3 * gTB, "", nil},
		{"append tail, last token", "A", gAddr(1, tail, 3), gTB, "", nil},
		{"committed token of the shared page", "A", gAddr(0, tail, 1), gTB, "not inside", nil},
		{"straddles base_len in the shared page", "A", gAddr(0, tail, 1), 2 * gTB, "not inside", nil},
		{"committed first page", "A", gAddr(0, va.Pages[0], 0), gTB, "not inside", nil},
		{"past the last reserved token", "A", gAddr(0, next, 2), 2 * gTB, "runs past", nil},
		{"after the last reserved token", "A", gAddr(0, next, 3), gTB, "not inside", nil},
		{"free page", "A", gAddr(0, free, 0), gTB, "not inside", nil},
		{"other committed snapshot", "A", gAddr(1, vc.Pages[1], 0), gTB, "not inside", nil},
		{"between the buffers", "A", gBufs[0] + 16*gItem, 8, "not inside", nil},
		{"another session's reservation, first writer binds it", "B", gAddr(0, pb, 0), gPS * gTB, "", nil},
		{"that reservation by another peer", "A", gAddr(1, pb, 1), gTB, `belongs to peer "B"`, nil},
		{"the first reservation by that other peer", "B", gAddr(0, tail, 2), gTB, `belongs to peer "A"`, nil},
		{"empty", "A", gAddr(0, tail, 2), 0, "empty or wraps", nil},
		{"wraps", "A", ^uint64(0) - 3, 8, "empty or wraps", nil},
		{"still allowed before the commit", "A", gAddr(0, next, 0), gTB, "", func() {
			if _, err := s.Commit(ra.ID); err != nil {
				t.Fatal(err)
			}
		}},
		{"committed append", "A", gAddr(0, next, 0), gTB, "not inside", func() {
			if err := s.Abort(rb.ID); err != nil {
				t.Fatal(err)
			}
		}},
		{"aborted reservation", "B", gAddr(0, pb, 0), gTB, "not inside", nil},
	}
	for _, tt := range tests {
		err := s.CheckWrite(tt.peer, tt.addr, tt.n)
		switch {
		case tt.refuse == "" && err != nil:
			t.Fatalf("%s: refused: %v", tt.name, err)
		case tt.refuse != "" && (err == nil || !strings.Contains(err.Error(), tt.refuse)):
			t.Fatalf("%s: got %v, want a refusal naming %q", tt.name, err, tt.refuse)
		}
		if tt.afterward != nil {
			tt.afterward()
		}
	}
	for pg := range s.gpages {
		if g := s.gpages[pg].Load(); g != nil {
			t.Fatalf("page %d still writable with nothing in flight: %+v", pg, g)
		}
	}

	// An expired reservation is no longer writable.
	rd, err := s.Reserve("d", 1, 0, 2, "d0")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CheckWrite("A", gAddr(1, rd.Pages[0], 0), 2*gTB); err != nil {
		t.Fatal(err)
	}
	clock = clock.Add(2 * time.Second)
	s.Expire()
	if err := s.CheckWrite("A", gAddr(1, rd.Pages[0], 0), 2*gTB); err == nil {
		t.Fatal("expired reservation still writable")
	}
}

// TestWriteGuardSpans checks the writable bytes of reservations against a byte map built token
// by token, with equally spaced buffers (found by division) and with buffers in no order, two of
// them back to back (found by binary search).
func TestWriteGuardSpans(t *testing.T) {
	saved := gBufs
	defer func() { gBufs = saved }()
	for _, bufs := range [][]uint64{saved, {0x380000, 0x100000 + 16*gItem, 0x300000, 0x100000}} {
		gBufs = bufs
		t.Run(fmt.Sprintf("%d buffers", len(bufs)), testWriteGuardSpans)
	}
}

func testWriteGuardSpans(t *testing.T) {
	s := newGuardedStore(t, nil)
	mustIngest(t, s, "x", 1, 0, 3)  // page 0 holds tokens 0..2
	mustIngest(t, s, "y", 1, 0, 4)  // a page between
	mustIngest(t, s, "x2", 1, 0, 5) // two more
	r, err := s.Reserve("x", 1, 3, 10, "d")
	if err != nil {
		t.Fatal(err)
	}
	writable := map[uint64]bool{}
	for tok := int64(3); tok < 13; tok++ {
		pg := r.Pages[tok/gPS-r.FirstPage]
		for b := range gBufs {
			for k := uint64(0); k < gTB; k++ {
				writable[gAddr(b, pg, tok%gPS)+k] = true
			}
		}
	}
	for b := range gBufs {
		for a := gBufs[b] - 1; a < gBufs[b]+16*gItem+1; a++ {
			if got := s.CheckWrite("p", a, 1) == nil; got != writable[a] {
				t.Fatalf("byte %#x: writable %v, want %v", a, got, writable[a])
			}
		}
	}
}

func TestWriteGuardNamedWriter(t *testing.T) {
	s := newGuardedStore(t, nil)
	r, err := s.ReserveFor("n", 1, 0, 4, "d0", "W")
	if err != nil {
		t.Fatal(err)
	}
	a := gAddr(0, r.Pages[0], 0)
	if err := s.CheckWrite("X", a, gTB); err == nil || !strings.Contains(err.Error(), `belongs to peer "W", not to "X"`) {
		t.Fatalf("first write by another peer: %v", err)
	}
	if err := s.CheckWrite("W", a, gPS*gTB); err != nil {
		t.Fatalf("the named writer: %v", err)
	}
	if err := s.CheckWrite("X", a, gTB); err == nil {
		t.Fatal("another peer after the named writer wrote")
	}
}

func TestWriteGuardUnguarded(t *testing.T) {
	s := newStore(t, 4, nil, nil)
	if err := s.CheckWrite("p", 123, 4); err != nil {
		t.Fatalf("store without buffers refused a write: %v", err)
	}
	if _, err := New(Config{PageSize: 4, PageBytes: 100, PageCount: 4, Buffers: gBufs}); err == nil {
		t.Fatal("100 page bytes over 2 buffers of 4-token pages accepted")
	}
}

// FuzzWriteGuard drives reservations, appends, commits and aborts from the input and checks
// CheckWrite on ranges from the input against a byte map built from the open reservations.
func FuzzWriteGuard(f *testing.F) {
	f.Add([]byte{0, 9, 1, 0, 0, 3, 7, 2, 5, 200, 17, 4, 1, 0})
	f.Add([]byte{0, 16, 0, 30, 1, 0, 0, 6, 2, 1, 4, 0, 255, 255, 3, 0, 3, 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		s := newGuardedStore(t, nil)
		type open struct {
			id    uint64
			bytes map[uint64]bool
		}
		opens := map[string]*open{}
		next := func() byte {
			if len(in) == 0 {
				return 0
			}
			b := in[0]
			in = in[1:]
			return b
		}
		sessions := []string{"a", "b", "c"}
		for steps := 0; len(in) > 0 && steps < 64; steps++ {
			sess := sessions[int(next())%len(sessions)]
			switch next() % 4 {
			case 0: // reserve: a full push or an append to the stored seqlen
				tokens := int64(next()%20) + 1
				var base int64
				if v, ok := s.Get(sess); ok && next()%2 == 0 {
					base = v.Seqlen
				}
				r, err := s.Reserve(sess, 1, base, tokens, "d")
				if err != nil {
					continue
				}
				o := &open{id: r.ID, bytes: map[uint64]bool{}}
				for tok := base; tok < base+tokens; tok++ {
					pg := r.Pages[tok/gPS-r.FirstPage]
					for b := range gBufs {
						for k := uint64(0); k < gTB; k++ {
							o.bytes[gAddr(b, pg, tok%gPS)+k] = true
						}
					}
				}
				opens[sess] = o
			case 1:
				if o := opens[sess]; o != nil {
					_, _ = s.Commit(o.id)
					delete(opens, sess)
				}
			case 2:
				if o := opens[sess]; o != nil {
					_ = s.Abort(o.id)
					delete(opens, sess)
				}
			case 3: // a write: buffer, page, token, byte offset and length from the input
				b, pg, tok, off := int(next())%len(gBufs), int64(next())%17, int64(next())%gPS, uint64(next()%gTB)
				n := uint64(next()) + 1
				addr := gAddr(b, pg, tok) + off
				want := false
				for _, o := range opens {
					all := true
					for a := addr; a < addr+n; a++ {
						if !o.bytes[a] {
							all = false
							break
						}
					}
					want = want || all
				}
				if got := s.CheckWrite("p", addr, n) == nil; got != want {
					t.Fatalf("write [%#x, +%d): allowed %v, want %v", addr, n, got, want)
				}
			}
		}
	})
}
