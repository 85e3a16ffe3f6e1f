package store

import (
	"container/list"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Evict reasons.
const (
	ReasonCapacity = "capacity"
	ReasonReplaced = "replaced"
	ReasonReleased = "released"
)

// Entry is one session's snapshot. Pages[i] holds tokens [i·page_size, (i+1)·page_size).
type Entry struct {
	Session    string
	Generation uint64
	Seqlen     int64
	Pages      []int64
	Source     string
	Updated    time.Time

	// ids are the token ids of [0, Seqlen) the entry was pushed with (ReserveIDs), or nil: an
	// entry holds ids for its whole range or none. Read through TokenIDs (a copy).
	ids     []int32
	elem    *list.Element
	readers int
	dead    bool // removed from the index; pages freed when the last reader leaves
}

// View is a read-only copy of an entry.
type View struct {
	Session    string
	Generation uint64
	Seqlen     int64
	Pages      []int64
	Source     string
	Updated    time.Time
	Bytes      int64
	// HasIDs: the entry holds the token ids of [0, Seqlen) (TokenIDs).
	HasIDs bool
}

// Reservation is the answer to Reserve: the store pages that cover tokens
// [FirstPage·page_size, base_len+tokens).
type Reservation struct {
	ID        uint64
	Pages     []int64
	FirstPage int64
	// Credit is the writer's store credit after the reservation (credit.go); zero without one.
	Credit Credit
}

// Ingest is an open reservation as the peer API sees it: the store's pending table is the only
// record of an ingest in flight (the sidecar keeps none of its own), so commit, abort and expiry
// end it in one place.
type Ingest struct {
	ID         uint64
	Session    string
	Generation uint64
	BaseLen    int64
	Tokens     int64
	Source     string // the source (decode) worker id named at reserve
	Started    time.Time
	Deadline   time.Time // freed when not committed or aborted by then
}

// ExpireFunc is called (without the store lock) for every reservation freed by its deadline.
type ExpireFunc func(in Ingest)

type pending struct {
	id       uint64
	session  string
	gen      uint64
	base     int64
	tokens   int64
	source   string
	full     bool
	entry    *Entry // the entry appended to (nil for a full push)
	from     uint64 // the appended entry's generation at reserve (≠ gen: a re-tag)
	pages    []int64
	owned    []int64
	created  time.Time
	deadline time.Time
	guard    *guardRes // its writable span in the write guard (nil without Config.Buffers)
	ids      []int32   // the token ids of [base, base+tokens) or, with idsFrom0, of [0, base+tokens); nil: none (ReserveIDs)
	idsFrom0 bool
}

// CutFunc is called (without the store lock) with an entry a re-tag append cut back to its base,
// and the seqlen it had before.
type CutFunc func(v View, was int64)

// EvictFunc is called (without the store lock) for every entry that leaves the store for a
// reason other than a commit of the same session.
type EvictFunc func(v View, reason string)

// Config sizes the store.
type Config struct {
	PageSize int64
	// PageBytes is the bytes of one store page over all buffers (2·layers·item_len).
	PageBytes int64
	PageCount int64
	// ReserveTimeout frees a reservation left without commit or abort (30s).
	ReserveTimeout time.Duration
	OnEvict        EvictFunc
	// OnExpire is told of every reservation its deadline freed (nil: nobody).
	OnExpire ExpireFunc
	// OnCut is told (without the store lock) of every entry a re-tag append cut back to its
	// base (ReserveRetag): the entry now holds [0, base) of its old generation (nil: nobody).
	OnCut CutFunc
	Now   func() time.Time
	// Buffers, when set, are the addresses of the store's 2·layers buffers (page p of buffer b at
	// Buffers[b] + p·PageBytes/len(Buffers)); the store then keeps a write guard over them
	// (CheckWrite, installed as the transfer engine's rdma.WriteGuard).
	Buffers []uint64
	// CreditTimeout frees a writer's credit left unused this long (5m); CreditMaxPages caps all
	// credits together (0: a tenth of the store; negative: no credits). See credit.go.
	CreditTimeout  time.Duration
	CreditMaxPages int64
}

// Store is safe for concurrent use.
type Store struct {
	cfg Config

	mu       sync.Mutex
	free     []bool // free[p]
	nfree    int64
	entries  map[string]*Entry
	lru      *list.List // front = most recent
	pend     map[uint64]*pending
	bySess   map[string]uint64
	nextID   uint64
	pinsByID map[string]int // pins taken by PushSnapshot commands before the offer arrives

	credits     map[string]*credit // by writer (credit.go)
	creditPages int64              // pages in all credits
	creditSeq   uint64             // the last credit id handed out (starts at a random base)

	// The write guard (guard.go): buffer start addresses sorted, bytes of a page per buffer and of
	// a buffer, and per store page its writable bytes.
	gbufs   []uint64
	gItem   uint64
	gBufLen uint64
	gStride uint64 // distance between consecutive buffers when they are equally spaced, else 0
	gpages  []atomic.Pointer[pageGuard]

	idBytes int64 // bytes of the token ids held by entries and reservations (4 per token)
}

// New builds an empty store.
func New(cfg Config) (*Store, error) {
	if cfg.PageSize <= 0 || cfg.PageBytes <= 0 || cfg.PageCount <= 0 {
		return nil, fmt.Errorf("store: bad geometry (page size %d, page bytes %d, pages %d)", cfg.PageSize, cfg.PageBytes, cfg.PageCount)
	}
	if cfg.ReserveTimeout <= 0 {
		cfg.ReserveTimeout = 30 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.CreditTimeout <= 0 {
		cfg.CreditTimeout = 5 * time.Minute
	}
	if cfg.CreditMaxPages == 0 {
		cfg.CreditMaxPages = cfg.PageCount / 10
	}
	s := &Store{cfg: cfg, free: make([]bool, cfg.PageCount), nfree: cfg.PageCount,
		entries: map[string]*Entry{}, lru: list.New(), pend: map[uint64]*pending{}, bySess: map[string]uint64{},
		credits: map[string]*credit{}, creditSeq: creditBase()}
	for i := range s.free {
		s.free[i] = true
	}
	if err := s.initGuard(); err != nil {
		return nil, err
	}
	return s, nil
}

// CapacityBytes is the store size in bytes.
func (s *Store) CapacityBytes() int64 { return s.cfg.PageCount * s.cfg.PageBytes }

// UsedBytes is the bytes of allocated pages (entries and reservations).
func (s *Store) UsedBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return (s.cfg.PageCount - s.nfree) * s.cfg.PageBytes
}

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

func (s *Store) view(e *Entry) View {
	return View{Session: e.Session, Generation: e.Generation, Seqlen: e.Seqlen, Pages: append([]int64(nil), e.Pages...),
		Source: e.Source, Updated: e.Updated, Bytes: int64(len(e.Pages)) * s.cfg.PageBytes, HasIDs: e.ids != nil}
}

// Reserve reserves store pages for tokens [base, base+tokens) of (session, gen). base 0 starts a
// full snapshot that replaces the current one at commit; any other base must equal the seqlen of
// the stored generation (else FAILED_PRECONDITION naming that seqlen). Older generations are
// refused; eviction of least recently used entries makes room.
func (s *Store) Reserve(session string, gen uint64, base, tokens int64, source string) (Reservation, error) {
	return s.ReserveFor(session, gen, base, tokens, source, "")
}

// ReserveFor is Reserve for a known writer: with the write guard (Config.Buffers), only writes
// from peer writer (the segment name its engine announces) are accepted into the reservation.
// An empty writer binds the reservation to the first peer that writes into it.
func (s *Store) ReserveFor(session string, gen uint64, base, tokens int64, source, writer string) (Reservation, error) {
	return s.ReserveCredit(session, gen, base, tokens, source, writer, CreditRequest{})
}

// ReserveCredit is ReserveFor with store credit (credit.go): the reservation's first cr.Use
// pages are the writer's first credit pages (checked against cr.ID; a full push only), and the
// writer's credit is topped up to cr.Pages free pages afterwards. Reservation.Credit is the
// writer's credit after the call.
func (s *Store) ReserveCredit(session string, gen uint64, base, tokens int64, source, writer string, cr CreditRequest) (Reservation, error) {
	return s.ReserveRetag(session, gen, base, tokens, source, writer, cr, 0)
}

// ReserveRetag is ReserveCredit that may re-tag (no full re-push after a reseed): with retag ≠ 0
// an append (base > 0) of generation gen is accepted onto the stored entry of generation retag
// (< gen) when its seqlen is base — the writer's worker received exactly that snapshot by a
// reseed — and the entry takes generation gen at commit. An entry already of generation gen
// takes a plain append. Anything else is a base mismatch (the writer then pushes everything).
//
// Cut back: when the entry of generation retag is longer than base (the reseed used only a
// prefix of it: the new turn's prompt was shorter or diverged), the re-tag cuts the entry back
// to base right here — seqlen base, the pages past base's page freed, still generation retag —
// and appends onto that, provided nobody reads (Acquire) or pins (Pin) the entry: the append
// overwrites tokens [base, old seqlen) in place, which a reseed of the old entry could be
// reading. Read or pinned, it is a base mismatch as before. The cut stands whatever becomes of
// the reservation (an abort or expiry leaves [0, base) of generation retag, never bytes the
// append may have overwritten); Config.OnCut reports it.
func (s *Store) ReserveRetag(session string, gen uint64, base, tokens int64, source, writer string, cr CreditRequest, retag uint64) (Reservation, error) {
	return s.ReserveIDs(session, gen, base, tokens, source, writer, cr, retag, nil)
}

// ReserveIDs is ReserveRetag with token ids (nil: none): those of [base, base+tokens) (tokens
// of them) or, for an append, of [0, base+tokens) (base+tokens of them), each in [0, 2^31),
// else INVALID_ARGUMENT. They become the entry's at commit when they cover [0, seqlen): a full
// push's, an append's from 0 (they replace the entry's: the writer's [0, base) is the entry's
// by the base match), or a range appended onto an entry that holds the ids of [0, base); any
// other commit leaves the entry without ids. A cut back cuts its ids with it, a re-tag keeps
// them. Memory: 4 bytes a token held beside the entry's pages (a page's KV is
// page_size·kv_bytes_per_token, ~100 KB a token for a 70B-class model, so the ids add about
// 0.004 % to the store's footprint); IDBytes counts them (IDCapacityBytes bounds them).
func (s *Store) ReserveIDs(session string, gen uint64, base, tokens int64, source, writer string, cr CreditRequest, retag uint64, ids []int32) (Reservation, error) {
	if tokens <= 0 || base < 0 {
		return Reservation{}, status.Errorf(codes.InvalidArgument, "bad range: base_len %d, tokens %d", base, tokens)
	}
	idsFrom0 := base > 0 && int64(len(ids)) == base+tokens
	if idsFrom0 {
		if err := kvcv1.ValidateTokenIDs("token_ids", ids, base+tokens); err != nil {
			return Reservation{}, status.Error(codes.InvalidArgument, err.Error())
		}
	} else if err := kvcv1.ValidateTokenIDs("token_ids", ids, tokens); err != nil {
		return Reservation{}, status.Errorf(codes.InvalidArgument, "%v (or %d from token 0)", err, base+tokens)
	}
	if base+tokens < base {
		return Reservation{}, status.Error(codes.InvalidArgument, "range overflows")
	}
	var evicted []View
	var expired []Ingest
	var cut *View // the entry as a cut back left it
	var cutFrom int64
	defer func() {
		s.notifyExpired(expired)
		for _, v := range evicted {
			s.notify(v, ReasonCapacity)
		}
		if cut != nil && s.cfg.OnCut != nil {
			s.cfg.OnCut(*cut, cutFrom)
		}
	}()
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.cfg.Now()
	expired = s.expireLocked(now)
	if err := s.checkCreditLocked(base, tokens, writer, cr); err != nil {
		return Reservation{}, err
	}
	if id, busy := s.bySess[session]; busy {
		return Reservation{}, kvxfer.PeerStatus(codes.Aborted, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_INGEST_BUSY, IngestId: id},
			"session %s already has ingest %d in flight", session, id)
	}
	e := s.entries[session]
	if e != nil && gen < e.Generation {
		return Reservation{}, kvxfer.PeerStatus(codes.FailedPrecondition, stored(kvcv1.PeerErrorReason_PEER_ERROR_REASON_GENERATION_STALE, e),
			"generation %d is older than the stored generation %d (seqlen %d)", gen, e.Generation, e.Seqlen)
	}
	ps := s.cfg.PageSize
	p := &pending{session: session, gen: gen, base: base, tokens: tokens, source: source, created: now, deadline: now.Add(s.cfg.ReserveTimeout)}
	var need int64
	var firstPage int64
	var drop []int64 // the entry's pages a cut back frees
	if base == 0 {
		p.full = true
		need = ceilDiv(tokens, ps)
	} else {
		// the generation the stored entry must have: the push's own, or for a re-tag the one the
		// writer's worker received by a snapshot reseed (the entry takes gen at commit)
		want := gen
		if retag != 0 && (e == nil || e.Generation != gen) {
			want = retag
		}
		var seqlen int64
		if e != nil && e.Generation == want {
			seqlen = e.Seqlen
		}
		// a re-tag onto a longer entry cuts it back to base (see above) when nobody reads it
		cutBack := want != gen && want < gen && seqlen > base && e.readers == 0 && s.pinsByID[session] == 0
		if (seqlen != base && !cutBack) || (want != gen && want >= gen) {
			return Reservation{}, kvxfer.PeerStatus(codes.FailedPrecondition, stored(kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH, e),
				"base_len %d does not match the stored seqlen %d of generation %d", base, seqlen, want)
		}
		p.entry, p.from = e, e.Generation
		firstPage = base / ps
		keep := int64(len(e.Pages))
		if cutBack {
			keep = ceilDiv(base, ps) // the pages of [0, base); the rest are freed by the cut
			drop = e.Pages[keep:]
		}
		need = ceilDiv(base+tokens, ps) - keep
		p.pages = append(p.pages, e.Pages[firstPage:keep]...)
	}
	if need > s.cfg.PageCount {
		return Reservation{}, kvxfer.PeerStatus(codes.ResourceExhausted, storeFull, "reserve of %d pages (%d bytes) is larger than the store (%d pages, %d bytes)",
			need, need*s.cfg.PageBytes, s.cfg.PageCount, s.CapacityBytes())
	}
	use := cr.Use
	for s.nfree+int64(len(drop)) < need-use {
		v, ok := s.evictOneLocked(e, p.full)
		if !ok {
			return Reservation{}, kvxfer.PeerStatus(codes.ResourceExhausted, storeFull, "store full: %d pages free, %d needed, nothing evictable", s.nfree+int64(len(drop)), need)
		}
		evicted = append(evicted, v)
	}
	if p.entry != nil && e.Seqlen != base {
		// the cut back, only now that the reservation cannot fail: the entry holds [0, base)
		cutFrom = e.Seqlen
		s.freeLocked(drop)
		e.Pages = e.Pages[: len(e.Pages)-len(drop) : len(e.Pages)-len(drop)]
		e.Seqlen = base // Updated stays: what is left is no newer than it was
		if e.ids != nil {
			s.idBytes -= 4 * int64(len(e.ids)-int(base))
			e.ids = e.ids[:base:base]
		}
		v := s.view(e)
		cut = &v
	}
	p.owned = append(s.takeCreditLocked(writer, use), s.allocLocked(need-use)...)
	p.pages = append(p.pages, p.owned...)
	if len(ids) > 0 {
		p.ids, p.idsFrom0 = append([]int32(nil), ids...), idsFrom0
		s.idBytes += 4 * int64(len(p.ids))
	}
	s.nextID++
	p.id = s.nextID
	s.pend[p.id] = p
	s.bySess[session] = p.id
	s.guardLocked(p, firstPage, writer)
	c := s.topUpCreditLocked(writer, cr.Pages, use > 0, now)
	return Reservation{ID: p.id, Pages: append([]int64(nil), p.pages...), FirstPage: firstPage, Credit: c}, nil
}

// evictOneLocked removes the least recently used evictable entry other than keep (the session's
// own entry); keep goes last, only for a full push (which replaces it anyway) and only if nothing
// else is left.
func (s *Store) evictOneLocked(keep *Entry, allowKeep bool) (View, bool) {
	for el := s.lru.Back(); el != nil; el = el.Prev() {
		e := el.Value.(*Entry)
		if e == keep || e.readers > 0 || s.pinsByID[e.Session] > 0 {
			continue
		}
		if _, busy := s.bySess[e.Session]; busy && e != keep {
			// an append to e is reserved; evicting it would strand that ingest
			if pe := s.pend[s.bySess[e.Session]]; pe != nil && pe.entry == e {
				continue
			}
		}
		v := s.view(e)
		s.removeLocked(e)
		return v, true
	}
	if allowKeep && keep != nil && keep.readers == 0 && !keep.dead && s.pinsByID[keep.Session] == 0 {
		v := s.view(keep)
		s.removeLocked(keep)
		return v, true
	}
	return View{}, false
}

// removeLocked drops e from the index and frees its pages (now, or when its last reader leaves).
func (s *Store) removeLocked(e *Entry) {
	if s.entries[e.Session] == e {
		delete(s.entries, e.Session)
	}
	if e.elem != nil {
		s.lru.Remove(e.elem)
		e.elem = nil
	}
	e.dead = true
	s.setIDsLocked(e, nil)
	if e.readers == 0 {
		s.freeLocked(e.Pages)
		e.Pages = nil
	}
}

// allocLocked takes n free pages, as one contiguous run when there is one (first fit), else the
// lowest free pages. The caller checked nfree ≥ n.
func (s *Store) allocLocked(n int64) []int64 {
	if n == 0 {
		return nil
	}
	out := make([]int64, 0, n)
	var run int64
	for i := int64(0); i < s.cfg.PageCount; i++ {
		if !s.free[i] {
			run = 0
			continue
		}
		run++
		if run == n {
			for p := i - n + 1; p <= i; p++ {
				s.free[p] = false
				out = append(out, p)
			}
			s.nfree -= n
			return out
		}
	}
	for i := int64(0); i < s.cfg.PageCount && int64(len(out)) < n; i++ {
		if s.free[i] {
			s.free[i] = false
			out = append(out, i)
		}
	}
	s.nfree -= n
	return out
}

func (s *Store) freeLocked(pages []int64) {
	for _, p := range pages {
		if !s.free[p] {
			s.free[p] = true
			s.nfree++
		}
	}
}

// Commit makes a reservation's tokens part of the snapshot and returns the new seqlen.
func (s *Store) Commit(id uint64) (View, error) {
	v, _, err := s.CommitIngest(id)
	return v, err
}

// CommitIngest is Commit that also returns the ingest it ended (also when the commit fails
// after the reservation was found: the reservation is gone either way).
func (s *Store) CommitIngest(id uint64) (_ View, in Ingest, _ error) {
	var replaced *View
	s.mu.Lock()
	p, ok := s.pend[id]
	if !ok {
		s.mu.Unlock()
		return View{}, Ingest{}, status.Errorf(codes.NotFound, "ingest %d unknown (expired, aborted or committed)", id)
	}
	in = p.ingest()
	delete(s.pend, id)
	delete(s.bySess, p.session)
	s.unguardLocked(p)
	s.dropPendingIDsLocked(p) // the entry's ids are counted again below
	now := s.cfg.Now()
	cur := s.entries[p.session]
	var e *Entry
	if p.full {
		if cur != nil && cur.Generation > p.gen {
			s.freeLocked(p.owned)
			s.mu.Unlock()
			return View{}, in, kvxfer.PeerStatus(codes.FailedPrecondition, stored(kvcv1.PeerErrorReason_PEER_ERROR_REASON_GENERATION_STALE, cur),
				"generation %d was replaced by %d", p.gen, cur.Generation)
		}
		if cur != nil {
			if cur.Generation != p.gen {
				v := s.view(cur)
				replaced = &v
			}
			s.removeLocked(cur)
		}
		e = &Entry{Session: p.session, Generation: p.gen, Pages: p.owned}
		e.elem = s.lru.PushFront(e)
		s.entries[p.session] = e
		s.setIDsLocked(e, p.ids)
	} else {
		e = p.entry
		if e.dead || cur != e || e.Seqlen != p.base || e.Generation != p.from {
			s.freeLocked(p.owned)
			s.mu.Unlock()
			return View{}, in, kvxfer.PeerStatus(codes.FailedPrecondition, stored(kvcv1.PeerErrorReason_PEER_ERROR_REASON_SNAPSHOT_CHANGED, cur),
				"snapshot of %s changed during the ingest; base_len %d no longer matches", p.session, p.base)
		}
		e.Generation = p.gen // a re-tag: the entry now belongs to the writer's residency
		e.Pages = append(e.Pages, p.owned...)
		switch {
		case p.idsFrom0:
			s.setIDsLocked(e, p.ids) // the writer's [0, base) is the entry's (the base matched)
		case e.ids != nil && p.ids != nil:
			s.setIDsLocked(e, append(e.ids, p.ids...)) // [0, base) then [base, base+tokens)
		default:
			s.setIDsLocked(e, nil) // the range's ids are not all known
		}
		s.lru.MoveToFront(e.elem)
	}
	e.Seqlen = p.base + p.tokens
	e.Source = p.source
	e.Updated = now
	v := s.view(e)
	s.mu.Unlock()
	if replaced != nil {
		s.notify(*replaced, ReasonReplaced)
	}
	return v, in, nil
}

// Abort frees a reservation; the existing snapshot stays valid for what it covers.
func (s *Store) Abort(id uint64) error {
	_, err := s.AbortIngest(id)
	return err
}

// AbortIngest is Abort that also returns the ingest it ended.
func (s *Store) AbortIngest(id uint64) (Ingest, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pend[id]
	if !ok {
		return Ingest{}, status.Errorf(codes.NotFound, "ingest %d unknown (expired, aborted or committed)", id)
	}
	s.abortLocked(p)
	return p.ingest(), nil
}

// Ingest returns an open reservation.
func (s *Store) Ingest(id uint64) (Ingest, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pend[id]
	if !ok {
		return Ingest{}, false
	}
	return p.ingest(), true
}

// Touch moves an open reservation's deadline to now + the reserve timeout (a writer that is
// still writing into it: a seed's chunks, sidecar-prefill's SendKV to_store); false when it is
// gone (committed, aborted or expired).
func (s *Store) Touch(id uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pend[id]
	if ok {
		p.deadline = s.cfg.Now().Add(s.cfg.ReserveTimeout)
	}
	return ok
}

// Ingests returns every open reservation, by id.
func (s *Store) Ingests() []Ingest {
	s.mu.Lock()
	out := make([]Ingest, 0, len(s.pend))
	for _, p := range s.pend {
		out = append(out, p.ingest())
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

func (p *pending) ingest() Ingest {
	return Ingest{ID: p.id, Session: p.session, Generation: p.gen, BaseLen: p.base, Tokens: p.tokens, Source: p.source,
		Started: p.created, Deadline: p.deadline}
}

func (s *Store) abortLocked(p *pending) {
	delete(s.pend, p.id)
	delete(s.bySess, p.session)
	s.unguardLocked(p)
	s.dropPendingIDsLocked(p)
	s.freeLocked(p.owned)
}

// expireLocked frees the reservations past their deadline and returns them (for OnExpire,
// called by the caller once the lock is released).
func (s *Store) expireLocked(now time.Time) []Ingest {
	var out []Ingest
	for _, p := range s.pend {
		if now.After(p.deadline) {
			s.abortLocked(p)
			out = append(out, p.ingest())
		}
	}
	s.expireCreditsLocked(now)
	return out
}

// Expire frees reservations past their deadline (called periodically) and returns them; each
// also goes to Config.OnExpire.
func (s *Store) Expire() []Ingest {
	s.mu.Lock()
	out := s.expireLocked(s.cfg.Now())
	s.mu.Unlock()
	s.notifyExpired(out)
	return out
}

func (s *Store) notifyExpired(in []Ingest) {
	if s.cfg.OnExpire == nil {
		return
	}
	sort.Slice(in, func(i, j int) bool { return in[i].ID < in[j].ID })
	for _, x := range in {
		s.cfg.OnExpire(x)
	}
}

// Release drops a session's snapshot.
func (s *Store) Release(session string) bool {
	s.mu.Lock()
	e, ok := s.entries[session]
	var v View
	if ok {
		v = s.view(e)
		s.removeLocked(e)
	}
	s.mu.Unlock()
	if ok {
		s.notify(v, ReasonReleased)
	}
	return ok
}

// Acquire pins a session's snapshot for reading (a reseed) and touches it in the LRU. The
// returned release must be called once the read is over; until then the pages stay allocated.
func (s *Store) Acquire(session string) (View, func(), bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[session]
	if !ok {
		return View{}, nil, false
	}
	e.readers++
	s.lru.MoveToFront(e.elem)
	var once sync.Once
	return s.view(e), func() {
		once.Do(func() {
			s.mu.Lock()
			e.readers--
			if e.readers == 0 && e.dead {
				s.freeLocked(e.Pages)
				e.Pages = nil
			}
			s.mu.Unlock()
		})
	}, true
}

// Pin protects a session's snapshot from eviction (a reseed was decided and its offer is on the
// way); Unpin undoes it.
func (s *Store) Pin(session string) {
	s.mu.Lock()
	if s.pinsByID == nil {
		s.pinsByID = map[string]int{}
	}
	s.pinsByID[session]++
	if e, ok := s.entries[session]; ok {
		s.lru.MoveToFront(e.elem)
	}
	s.mu.Unlock()
}

// Unpin releases a Pin.
func (s *Store) Unpin(session string) {
	s.mu.Lock()
	if s.pinsByID[session] > 1 {
		s.pinsByID[session]--
	} else {
		delete(s.pinsByID, session)
	}
	s.mu.Unlock()
}

// Get returns a session's snapshot.
func (s *Store) Get(session string) (View, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[session]
	if !ok {
		return View{}, false
	}
	return s.view(e), true
}

// List returns every snapshot, sorted by session.
func (s *Store) List() []View {
	s.mu.Lock()
	out := make([]View, 0, len(s.entries))
	for _, e := range s.entries {
		out = append(out, s.view(e))
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Session < out[j].Session })
	return out
}

// Pending is the number of open reservations.
func (s *Store) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pend)
}

func (s *Store) notify(v View, reason string) {
	if s.cfg.OnEvict != nil {
		s.cfg.OnEvict(v, reason)
	}
}

// setIDsLocked replaces e's ids (nil: none), keeping IDBytes.
func (s *Store) setIDsLocked(e *Entry, ids []int32) {
	s.idBytes += 4 * int64(len(ids)-len(e.ids))
	e.ids = ids
}

// dropPendingIDsLocked forgets a reservation's ids (its commit hands them to the entry).
func (s *Store) dropPendingIDsLocked(p *pending) {
	s.idBytes -= 4 * int64(len(p.ids))
}

// IDBytes is the bytes of the token ids the store holds (entries and reservations, 4 a token).
func (s *Store) IDBytes() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.idBytes
}

// IDCapacityBytes bounds the entries' ids: an entry's never outnumber the tokens its pages
// hold, so they take at most 4 bytes for every token the store's pages can hold. Reservations
// add theirs while they are open (an append's ids from token 0 repeat its entry's base until
// the commit replaces them), so IDBytes stays below twice this.
func (s *Store) IDCapacityBytes() int64 { return 4 * s.cfg.PageCount * s.cfg.PageSize }

// TokenIDs returns a copy of the token ids of [0, seqlen) of the session's entry of generation
// gen, and the entry. It is NOT_FOUND without an entry, FAILED_PRECONDITION (PeerError
// BASE_MISMATCH naming the stored entry) for another generation or fewer than seqlen tokens;
// an entry without ids answers nil.
func (s *Store) TokenIDs(session string, gen uint64, seqlen int64) ([]int32, View, error) {
	if seqlen <= 0 {
		return nil, View{}, status.Errorf(codes.InvalidArgument, "seqlen %d must be positive", seqlen)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[session]
	if !ok {
		return nil, View{}, status.Errorf(codes.NotFound, "no snapshot of session %s", session)
	}
	if e.Generation != gen || e.Seqlen < seqlen {
		return nil, View{}, kvxfer.PeerStatus(codes.FailedPrecondition, stored(kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH, e),
			"the snapshot of %s is generation %d with %d tokens, not generation %d with %d or more", session, e.Generation, e.Seqlen, gen, seqlen)
	}
	v := s.view(e)
	if e.ids == nil {
		return nil, v, nil
	}
	return append([]int32(nil), e.ids[:seqlen]...), v, nil
}

var storeFull = &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_STORE_FULL}

// stored is a refusal's detail naming what the store holds of the session (e may be nil).
func stored(r kvcv1.PeerErrorReason, e *Entry) *kvcv1.PeerError {
	d := &kvcv1.PeerError{Reason: r}
	if e != nil {
		d.StoredSeqlen, d.StoredGeneration = e.Seqlen, e.Generation
	}
	return d
}
