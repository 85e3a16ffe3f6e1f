package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

func TestExtendIDs(t *testing.T) {
	base := extendIDs(nil, "s", 50, 1000)
	for _, tc := range []struct {
		name    string
		hist    []int64
		n       int64
		vocab   int64
		wantLen int
		prefix  []int64
	}{
		{"from nothing", nil, 50, 1000, 50, nil},
		{"extends the history", []int64{7, 8, 9}, 10, 1000, 10, []int64{7, 8, 9}},
		{"truncates (compaction)", []int64{1, 2, 3, 4}, 2, 1000, 2, []int64{1, 2}},
		{"default vocab", nil, 20, 0, 20, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := extendIDs(tc.hist, "s", tc.n, tc.vocab)
			if len(got) != tc.wantLen || !slices.Equal(got[:len(tc.prefix)], tc.prefix) {
				t.Fatalf("extendIDs = %v", got)
			}
			v := tc.vocab
			if v <= 0 {
				v = 1000
			}
			for _, x := range got[len(tc.prefix):] {
				if x < 0 || x >= v {
					t.Fatalf("id %d outside [0, %d)", x, v)
				}
			}
		})
	}
	if again := extendIDs(nil, "s", 50, 1000); !slices.Equal(again, base) {
		t.Fatal("not deterministic")
	}
	if other := extendIDs(nil, "t", 50, 1000); slices.Equal(other, base) {
		t.Fatal("sessions share their generated tokens")
	}
	// A position's token does not depend on how the history got there.
	if got := extendIDs(base[:30], "s", 50, 1000); !slices.Equal(got, base) {
		t.Fatal("extension differs from a fresh context")
	}
}

// TestReplaySendsHistory: with SendIDs every turn's input_ids are the previous turn's input_ids,
// then the output_ids its answer carried, then new tokens up to the turn's length; the
// refworker's recompute fields land in the records.
func TestReplaySendsHistory(t *testing.T) {
	var mu sync.Mutex
	var got [][]int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			InputIDs []int64 `json:"input_ids"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, "bad", 400)
			return
		}
		mu.Lock()
		got = append(got, body.InputIDs)
		turn := len(got)
		mu.Unlock()
		w.Header().Set("X-KVC-Mode", "SEED")
		w.Header().Set("Content-Type", "text/event-stream")
		for i := 0; i < 2; i++ {
			fmt.Fprintf(w, "data: {\"text\":\" x\",\"output_ids\":[%d],\"meta_info\":{\"completion_tokens\":%d,\"kvc\":{\"recompute_checked\":true,\"recompute_mismatches\":%d,\"max_abs_logit_diff\":0.5}}}\n\n", 5000+10*turn+i, i+1, turn-1)
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	wl := &workload.Workload{Name: "t", Sessions: []workload.Session{{ID: "s", Turns: []workload.Turn{
		{InputTokens: 10, OutputTokens: 2}, {InputTokens: 15, OutputTokens: 2}, {InputTokens: 16, OutputTokens: 2},
	}}}}
	recs, err := Replay(context.Background(), srv.URL, wl, Options{TimeScale: 1, SendIDs: true, RequestTimeout: 10 * time.Second})
	if err != nil || len(recs) != 3 {
		t.Fatalf("replay: %v, %d records", err, len(recs))
	}
	if len(got[0]) != 10 || len(got[1]) != 15 || len(got[2]) != 16 {
		t.Fatalf("lengths %d %d %d", len(got[0]), len(got[1]), len(got[2]))
	}
	if !slices.Equal(got[1][:12], append(slices.Clone(got[0]), 5010, 5011)) {
		t.Fatalf("turn 2 does not continue turn 1 and its answer: %v then %v", got[0], got[1])
	}
	if !slices.Equal(got[2][:15], got[1]) || got[2][15] != 5020 {
		t.Fatalf("turn 3 does not continue turn 2 and its answer: %v then %v", got[1], got[2])
	}
	for i, r := range recs {
		if !r.OK || !r.RecomputeChecked || r.RecomputeMismatches != int64(i) || r.MaxAbsLogitDiff != 0.5 {
			t.Fatalf("record %d: %+v", i, r)
		}
	}
}
