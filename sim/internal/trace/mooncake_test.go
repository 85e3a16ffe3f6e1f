package trace

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func seq(from, n int) string {
	var s []string
	for i := 0; i < n; i++ {
		s = append(s, fmt.Sprint(from+i))
	}
	return "[" + strings.Join(s, ",") + "]"
}

func TestReadRebuildsSessions(t *testing.T) {
	// Session A: blocks 0..3, then continues with 0..5 and 0..7 (shared prefix >= 3).
	// Session B: blocks 100..4 (unrelated). C shares only 2 blocks with A: a new session.
	trace := strings.Join([]string{
		`{"timestamp": 0, "input_length": 2000, "output_length": 10, "hash_ids": ` + seq(0, 4) + `}`,
		`{"timestamp": 5, "input_length": 2000, "output_length": 5, "hash_ids": ` + seq(100, 4) + `}`,
		`not json at all`,
		`{"timestamp": 10, "input_length": 3000, "output_length": 20, "hash_ids": ` + seq(0, 6) + `}`,
		`{"timestamp": 12, "input_length": -5, "output_length": 20, "hash_ids": []}`,
		`{"timestamp": 13, "input_length": 100, "output_length": 20, "hash_ids": ` + seq(0, 9) + `}`,
		`{"timestamp": 14, "output_length": 20}`,
		``,
		`{"timestamp": 15, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 77]}`,
		`{"timestamp": 20, "input_length": 4000, "output_length": 30, "hash_ids": ` + seq(0, 8) + `}`,
	}, "\n")
	w, st, err := Read(strings.NewReader(trace), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if st.Lines != 9 || st.Valid != 5 || st.BrokenLines != 2 || st.ImpossibleLengths != 2 {
		t.Fatalf("stats %+v", st)
	}
	if len(w.Sessions) != 3 || len(w.Sessions[0].Turns) != 3 || w.Sessions[0].Turns[2].InputTokens != 4000 || len(w.Sessions[1].Turns) != 1 {
		t.Fatalf("sessions %+v", w.Sessions)
	}
	if w.Sessions[0].Turns[1].At.Milliseconds() != 10 {
		t.Fatalf("arrival %v", w.Sessions[0].Turns[1].At)
	}
}

func TestReadMaxRequestsAndFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.jsonl")
	var b strings.Builder
	for i := 0; i < 50; i++ {
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": 4, "hash_ids": %s}`+"\n", i*10, 1536+i*512, seq(0, 3+i))
	}
	if err := os.WriteFile(p, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	w, st, err := Read(f, Options{MaxRequests: 20})
	if err != nil {
		t.Fatal(err)
	}
	if st.Valid != 20 || w.Requests() != 20 || len(w.Sessions) != 1 {
		t.Fatalf("stats %+v sessions %d", st, len(w.Sessions))
	}
}

func FuzzRead(f *testing.F) {
	f.Add(`{"timestamp": 0, "input_length": 2000, "output_length": 10, "hash_ids": [1,2,3,4]}` + "\n" + `{"timestamp": 1, "input_length": 2500, "output_length": 1, "hash_ids": [1,2,3,4,5]}`)
	f.Add("{\n}\n\x00\xff")
	f.Add(`{"timestamp": 1e300, "input_length": 1, "output_length": 1}`)
	f.Fuzz(func(t *testing.T, s string) {
		w, st, err := Read(strings.NewReader(s), Options{})
		if err != nil {
			return
		}
		if w.Requests() != st.Valid {
			t.Fatalf("%d requests from %d valid lines", w.Requests(), st.Valid)
		}
		for _, ses := range w.Sessions {
			for _, tr := range ses.Turns {
				if tr.InputTokens < 1 || tr.OutputTokens < 1 {
					t.Fatalf("impossible turn kept: %+v", tr)
				}
			}
		}
	})
}
