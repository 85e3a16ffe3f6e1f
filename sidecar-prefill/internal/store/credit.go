package store

import (
	"math/rand/v2"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Store credit: a writer (a decode engine, named by its segment name) holds a standing set of
// free store pages it may write into before it has a reservation, so that a full push starts
// copying at once and its ReserveSnapshot round trip overlaps the copy. A credit
//   - is allocated from free pages only (it never evicts a snapshot; with too few free pages, or
//     at the cap on all credits together, fewer pages are granted, possibly none); a top-up
//     goes to at most an equal share of the cap among the writers holding credit (a credit is
//     never shrunk, but a writer that holds more than its share gets less back after a use);
//   - counts as used, and is writable by its writer only (the write guard, whole pages);
//   - is taken first by the writer's next full reservation that names it (CreditRequest.Use,
//     checked against CreditRequest.ID): the reservation's first Use pages are credit[:Use],
//     already written, and the rest of the credit stays credit;
//   - is topped up to CreditRequest.Pages after each of the writer's reservations;
//   - is freed (and unguarded) after Config.CreditTimeout without a reservation of its writer.
//
// Credit ids are unique per store instance (a random base plus a counter) and name one exact
// page list: each change of the list (a use, a top-up, an expiry) gives a new id, so a writer
// holding an old answer, or the answer of a store that restarted since, is refused.

// CreditRequest is the credit part of a reservation.
type CreditRequest struct {
	Pages int64  // top the writer's credit up to this many pages afterwards (0: leave it)
	Use   int64  // the reservation's first Use pages are the writer's first credit pages
	ID    uint64 // the credit id the writer used (required with Use)
}

// Credit is a writer's credit: pages in the order the writer must use them, and their id.
type Credit struct {
	ID    uint64
	Pages []int64
}

type credit struct {
	id    uint64
	pages []int64
	used  time.Time // the last reservation of its writer
	guard *guardRes
}

func creditBase() uint64 {
	// The low 32 bits count; the base keeps ids of different store instances apart.
	return rand.Uint64() &^ 0xffffffff
}

// checkCreditLocked refuses a bad credit request before anything is allocated or consumed.
func (s *Store) checkCreditLocked(base, tokens int64, writer string, cr CreditRequest) error {
	switch {
	case cr.Pages < 0 || cr.Use < 0:
		return status.Errorf(codes.InvalidArgument, "credit_pages %d and use_credit_pages %d must not be negative", cr.Pages, cr.Use)
	case (cr.Pages > 0 || cr.Use > 0) && writer == "":
		return status.Error(codes.InvalidArgument, "store credit needs source_transfer_endpoint (the writer)")
	case cr.Use == 0:
		return nil
	case base != 0:
		return kvxfer.PeerStatus(codes.FailedPrecondition, creditRefused, "use_credit_pages needs a full push (base_len 0, not %d)", base)
	case cr.Use > ceilDiv(tokens, s.cfg.PageSize):
		return kvxfer.PeerStatus(codes.FailedPrecondition, creditRefused, "use_credit_pages %d is more than the %d pages of the push", cr.Use, ceilDiv(tokens, s.cfg.PageSize))
	}
	c := s.credits[writer]
	switch {
	case c == nil:
		return kvxfer.PeerStatus(codes.FailedPrecondition, creditRefused, "credit %d of %s unknown: the writer holds no credit (expired, or the store restarted)", cr.ID, writer)
	case c.id != cr.ID:
		return kvxfer.PeerStatus(codes.FailedPrecondition, creditRefused, "credit %d of %s is stale: its credit is now %d", cr.ID, writer, c.id)
	case cr.Use > int64(len(c.pages)):
		return kvxfer.PeerStatus(codes.FailedPrecondition, creditRefused, "use_credit_pages %d is more than the %d pages of credit %d", cr.Use, len(c.pages), c.id)
	}
	return nil
}

// takeCreditLocked removes the writer's first n credit pages (checked) for a reservation, whose
// guard then takes them over.
func (s *Store) takeCreditLocked(writer string, n int64) []int64 {
	if n == 0 {
		return nil
	}
	c := s.credits[writer]
	out := slices.Clone(c.pages[:n])
	c.pages = c.pages[n:]
	s.creditPages -= n
	return out
}

// topUpCreditLocked grows the writer's credit to want pages (free pages only, within the cap),
// refreshes its use time and returns it; changed says pages were already taken from it.
func (s *Store) topUpCreditLocked(writer string, want int64, changed bool, now time.Time) Credit {
	if writer == "" {
		return Credit{}
	}
	c := s.credits[writer]
	if c == nil {
		if want <= 0 {
			return Credit{}
		}
		c = &credit{}
		s.creditSeq++
		c.guard = newGuardRes(s.creditSeq, "credit of "+writer, writer)
		s.credits[writer] = c
	}
	c.used = now
	// Each writer's share of the cap: a writer tops up to at most cap / (writers holding credit),
	// so a writer that came first gives room to later ones as it uses its credit.
	share := s.cfg.CreditMaxPages / int64(len(s.credits))
	have := int64(len(c.pages))
	if add := min(want-have, share-have, s.nfree, s.cfg.CreditMaxPages-s.creditPages); add > 0 {
		pages := s.allocLocked(add)
		s.creditPages += add
		c.pages = append(c.pages, pages...)
		changed = true
		if s.guarded() {
			for _, pg := range pages {
				s.gpages[pg].Store(&pageGuard{res: c.guard, lo: 0, hi: s.gItem})
			}
		}
	}
	if len(c.pages) == 0 {
		delete(s.credits, writer)
		return Credit{}
	}
	if changed || c.id == 0 {
		s.creditSeq++
		c.id = s.creditSeq
	}
	return Credit{ID: c.id, Pages: slices.Clone(c.pages)}
}

// dropCreditLocked frees a writer's credit and withdraws its writable pages.
func (s *Store) dropCreditLocked(writer string, c *credit) {
	if s.guarded() {
		for _, pg := range c.pages {
			if g := s.gpages[pg].Load(); g != nil && g.res == c.guard {
				s.gpages[pg].Store(nil)
			}
		}
	}
	s.freeLocked(c.pages)
	s.creditPages -= int64(len(c.pages))
	delete(s.credits, writer)
}

func (s *Store) expireCreditsLocked(now time.Time) {
	for w, c := range s.credits {
		if now.Sub(c.used) > s.cfg.CreditTimeout {
			s.dropCreditLocked(w, c)
		}
	}
}

// CreditOf returns a writer's current credit (zero when it holds none).
func (s *Store) CreditOf(writer string) Credit {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.credits[writer]
	if c == nil {
		return Credit{}
	}
	return Credit{ID: c.id, Pages: slices.Clone(c.pages)}
}

// CreditPages is the number of pages held as credit by all writers together.
func (s *Store) CreditPages() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.creditPages
}

var creditRefused = &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_CREDIT_REFUSED}
