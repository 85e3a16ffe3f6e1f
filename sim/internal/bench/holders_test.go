package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestHoldersMost(t *testing.T) {
	ids := []string{"decode-0", "decode-1", "decode-2"}
	tests := []struct {
		name     string
		set      [][2]string // session, worker, in order
		resident map[string]int
		want     string
		wantN    int
	}{
		{"none routed: the first", nil, nil, "decode-0", 0},
		{"most sessions", [][2]string{{"a", "decode-1"}, {"b", "decode-2"}, {"c", "decode-2"}}, nil, "decode-2", 2},
		{"latest request wins", [][2]string{{"a", "decode-2"}, {"b", "decode-2"}, {"a", "decode-1"}, {"c", "decode-1"}}, nil, "decode-1", 2},
		{"tie: more resident", [][2]string{{"a", "decode-0"}, {"b", "decode-2"}}, map[string]int{"decode-0": 3, "decode-2": 5}, "decode-2", 1},
		{"tie, same resident: the earlier", [][2]string{{"a", "decode-0"}, {"b", "decode-2"}}, map[string]int{"decode-0": 4, "decode-2": 4}, "decode-0", 1},
		{"empty worker ignored", [][2]string{{"a", ""}, {"b", "decode-1"}}, nil, "decode-1", 1},
		{"a worker not a candidate", [][2]string{{"a", "decode-9"}, {"b", "decode-9"}, {"c", "decode-1"}}, nil, "decode-1", 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := NewHolders()
			for _, sw := range tt.set {
				h.Set(sw[0], sw[1])
			}
			got, n := h.Most(ids, tt.resident)
			if got != tt.want || n != tt.wantN {
				t.Fatalf("Most = %s, %d; want %s, %d", got, n, tt.want, tt.wantN)
			}
			if c := h.Count(got); c != n {
				t.Fatalf("Count(%s) = %d, Most said %d", got, c, n)
			}
		})
	}
	var nilH *Holders
	nilH.Set("a", "decode-0") // a replay without a tracker
}

// The replay tells Holders each session's decode worker from the answers' headers: the latest
// routed request wins, a refused one (503) moves nothing.
func TestReplaySetsHolders(t *testing.T) {
	route := map[string][]string{"s-a": {"decode-0", "decode-0", "decode-2"}, "s-b": {"decode-1", "decode-1", "decode-0"}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			KVC struct {
				Turn int `json:"turn"`
			} `json:"kvc"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, "bad", http.StatusBadRequest)
			return
		}
		sid := r.Header.Get("X-Session-ID")
		w.Header().Set("X-KVC-Decode-Worker", route[sid][body.KVC.Turn])
		if sid == "s-b" && body.KVC.Turn == 2 {
			w.Header().Set("X-KVC-Error-Kind", "REJECTED_BY_D")
			http.Error(w, `{"error":{"code":"no_capacity","message":"full"}}`, http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"text\":\"t\",\"meta_info\":{\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	h := NewHolders()
	if _, err := Replay(context.Background(), srv.URL, testWorkload(), Options{Arm: "E9", TimeScale: 1, Holders: h}); err != nil {
		t.Fatal(err)
	}
	ids := []string{"decode-0", "decode-1", "decode-2"}
	if got, n := h.Most(ids, nil); got != "decode-1" || n != 1 {
		t.Fatalf("Most = %s, %d; want decode-1, 1 (a tie with decode-2 goes to the earlier; s-b's refused turn 2 named decode-0)", got, n)
	}
	for w, want := range map[string]int{"decode-0": 0, "decode-1": 1, "decode-2": 1} {
		if c := h.Count(w); c != want {
			t.Errorf("Count(%s) = %d, want %d", w, c, want)
		}
	}
}
