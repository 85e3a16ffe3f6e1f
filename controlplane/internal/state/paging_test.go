package state

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestSmallest(t *testing.T) {
	cases := []struct {
		ids  []string
		k    int
		want []string
		more bool
	}{
		{nil, 3, nil, false},
		{[]string{"b", "a"}, 3, []string{"a", "b"}, false},
		{[]string{"c", "a", "b"}, 3, []string{"a", "b", "c"}, false},
		{[]string{"d", "c", "a", "b"}, 3, []string{"a", "b", "c"}, true},
		{[]string{"e", "d", "c", "b", "a"}, 1, []string{"a"}, true},
		{[]string{"a", "e", "b", "d", "c"}, 2, []string{"a", "b"}, true},
	}
	for _, tc := range cases {
		got, more := smallest(slices.Clone(tc.ids), tc.k)
		if !slices.Equal(got, tc.want) || more != tc.more {
			t.Errorf("smallest(%v, %d) = %v %v, want %v %v", tc.ids, tc.k, got, more, tc.want, tc.more)
		}
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		n, k := r.IntN(300), 1+r.IntN(50)
		ids := make([]string, n)
		for i := range ids {
			ids[i] = fmt.Sprintf("s-%06d", r.IntN(1_000_000))
		}
		want := slices.Clone(ids)
		slices.Sort(want)
		if len(want) > k {
			want = want[:k]
		}
		if got, more := smallest(ids, k); !slices.Equal(got, want) || more != (n > k) {
			t.Fatalf("n %d k %d: %v, want %v", n, k, got, want)
		}
	}
}

// listSortedUnderLock is ListSessions as it was before: every candidate id sorted while the
// routing lock is held (kept here to measure the difference).
func (s *State) listSortedUnderLock(after string, limit int) []*kvcv1.SessionRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	var ids []string
	for id := range s.sessions {
		if id > after {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	if len(ids) > limit {
		ids = ids[:limit]
	}
	recs := make([]*kvcv1.SessionRecord, 0, len(ids))
	for _, id := range ids {
		recs = append(recs, proto.Clone(s.sessions[id].rec).(*kvcv1.SessionRecord))
	}
	return recs
}

// BenchmarkListSessionsLock pages through 200,000 sessions 100 at a time. "max-wait-ms" is the
// longest a routing decision would have waited for the routing lock meanwhile (a goroutine
// takes and releases it in a loop), "ms/page" the pager's own time.
func BenchmarkListSessionsLock(b *testing.B) {
	s := New(Config{Log: zerolog.Nop()})
	for i := range 200_000 {
		id := fmt.Sprintf("sess-%07d", (i*7919)%200_000)
		s.sessions[id] = sessEntry{rec: &kvcv1.SessionRecord{SessionId: id, DecodeWorker: "d0", KvCommittedLen: int64(i)}}
	}
	probe := func(b *testing.B, page func(i int)) {
		stop := make(chan struct{})
		maxWait := make(chan time.Duration)
		go func() {
			var m time.Duration
			for {
				select {
				case <-stop:
					maxWait <- m
					return
				default:
				}
				t0 := time.Now()
				s.mu.Lock()
				m = max(m, time.Since(t0))
				s.mu.Unlock()
				time.Sleep(50 * time.Microsecond) // a decision rate, not a synchronization
			}
		}()
		start := time.Now()
		n := 0
		for b.Loop() {
			page(n)
			n++
		}
		el := time.Since(start)
		close(stop)
		b.ReportMetric(float64((<-maxWait).Microseconds())/1000, "max-wait-ms")
		b.ReportMetric(float64(el.Microseconds())/1000/float64(n), "ms/page")
	}
	b.Run("before:sorted-under-lock", func(b *testing.B) {
		probe(b, func(int) {
			if n := len(s.listSortedUnderLock("sess-0100000", 100)); n != 100 {
				b.Fatal(n)
			}
		})
	})
	b.Run("first-page", func(b *testing.B) {
		probe(b, func(int) {
			s.mu.Lock()
			s.idsGen++ // a session was created: the snapshot is taken again
			s.mu.Unlock()
			if recs, _ := s.ListSessions("", 100, ""); len(recs) != 100 {
				b.Fatal(len(recs))
			}
		})
	})
	b.Run("continuing-page", func(b *testing.B) {
		s.ListSessions("", 100, "")
		probe(b, func(i int) {
			after := fmt.Sprintf("sess-%07d", (i*100)%199_000)
			if recs, _ := s.ListSessions(after, 100, ""); len(recs) != 100 {
				b.Fatal(len(recs))
			}
		})
	})
}
