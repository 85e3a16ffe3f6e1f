package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// fakeGateway answers /generate like kvc-gateway: X-KVC-* headers, SGLang SSE chunks with
// meta_info.kvc. behave picks the answer per (session, turn).
func fakeGateway(t *testing.T, behave func(session string, turn int) string) (*httptest.Server, *sync.Map) {
	var seen sync.Map // session -> []time.Time of arrivals
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			KVC struct {
				InputTokens int64 `json:"input_tokens"`
				Turn        int   `json:"turn"`
			} `json:"kvc"`
			SamplingParams struct {
				MaxNewTokens int64 `json:"max_new_tokens"`
			} `json:"sampling_params"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, "bad", 400)
			return
		}
		sid := r.Header.Get("X-Session-ID")
		v, _ := seen.LoadOrStore(sid, &[]int{})
		*(v.(*[]int)) = append(*(v.(*[]int)), body.KVC.Turn)
		mode := "DIRECT_TO_D"
		if body.KVC.Turn == 0 {
			mode = "SEED"
		}
		w.Header().Set("X-KVC-Mode", mode)
		w.Header().Set("X-KVC-Reason", "SESSION_RESIDENT")
		w.Header().Set("X-KVC-Cached-Tokens", "100")
		how := behave(sid, body.KVC.Turn)
		switch how {
		case "loaded": // P loads 600 tokens of the snapshot from its store (prefill from the snapshot)
			w.Header().Set("X-KVC-Prefill-Load-Tokens", "600")
		case "retried": // served after the gateway retried an attempt on decode-1
			w.Header().Set("X-KVC-Retries", "1")
			w.Header().Set("X-KVC-Retried-From", "decode-1")
		case "503":
			w.Header().Set("X-KVC-Error-Kind", "REJECTED_BY_D")
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(503)
			fmt.Fprint(w, `{"error":{"code":"no_capacity","message":"full"}}`)
			return
		case "midstream":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"text\":\"a\",\"meta_info\":{\"completion_tokens\":1}}\n\n")
			fmt.Fprint(w, "data: {\"error\":{\"code\":\"worker_stream_ended\",\"message\":\"gone\",\"kind\":\"WORKER_ERROR\"}}\n\ndata: [DONE]\n\n")
			return
		case "cut":
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprint(w, "data: {\"text\":\"a\",\"meta_info\":{\"completion_tokens\":1}}\n\n")
			return // no [DONE]
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := int64(1); i <= body.SamplingParams.MaxNewTokens; i++ {
			fmt.Fprintf(w, "data: {\"text\":\"t\",\"meta_info\":{\"completion_tokens\":%d,\"kvc\":{\"kv_len_after\":%d,\"received_bytes\":64,\"verified_bytes\":64}}}\n\n", i, body.KVC.InputTokens+i)
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
		// Resumed mid-stream from decode-0 on decode-2, as the gateway names it in trailers;
		// "resumed-retried": its first continuation failed on decode-3 before its first token.
		// (A flushed, chunked stream, as the gateway's: a buffered answer gets a Content-Length
		// and no trailers.)
		if strings.HasPrefix(how, "resumed") {
			w.(http.Flusher).Flush()
		}
		switch how {
		case "resumed":
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-From", "decode-0")
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-Decode-Worker", "decode-2")
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-Attempts", "1")
		case "resumed-retried":
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-From", "decode-0")
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-Decode-Worker", "decode-2")
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-Attempts", "2")
			w.Header().Set(http.TrailerPrefix+"X-KVC-Resumed-Retried-From", "decode-3")
		}
	}))
	t.Cleanup(srv.Close)
	return srv, &seen
}

func testWorkload() *workload.Workload {
	mk := func(id string) workload.Session {
		return workload.Session{ID: id, Turns: []workload.Turn{
			{InputTokens: 1000, OutputTokens: 3},
			{Think: 20 * time.Millisecond, InputTokens: 1400, OutputTokens: 2},
			{Think: 20 * time.Millisecond, InputTokens: 1800, OutputTokens: 4},
		}}
	}
	return &workload.Workload{Name: "t", Sessions: []workload.Session{mk("s-a"), mk("s-b")}}
}

func TestReplayRecordsEveryRequest(t *testing.T) {
	gw, seen := fakeGateway(t, func(session string, turn int) string {
		switch {
		case session == "s-b" && turn == 1:
			return "503"
		case session == "s-b" && turn == 2:
			return "midstream"
		case session == "s-a" && turn == 2:
			return "cut"
		case session == "s-a" && turn == 1:
			return "retried"
		case session == "s-b" && turn == 0:
			return "loaded"
		}
		return ""
	})
	var out bytes.Buffer
	var progress []int
	recs, err := Replay(context.Background(), gw.URL, testWorkload(), Options{Arm: "E9", TimeScale: 1, Out: &out,
		Progress: func(done, total int, _ *report.Record) { progress = append(progress, done*100+total) }})
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 6 || len(progress) != 6 || progress[5] != 606 {
		t.Fatalf("%d records, progress %v", len(recs), progress)
	}
	if n := strings.Count(out.String(), "\n"); n != 6 {
		t.Fatalf("%d metrics lines", n)
	}
	by := map[string]report.Record{}
	for _, r := range recs {
		by[fmt.Sprintf("%s/%d", r.SessionID, r.Turn)] = r
	}
	ok := by["s-a/0"]
	if !ok.OK || ok.Mode != "SEED" || ok.ReceivedBytes != 64 || ok.KVLenAfter != 1003 || ok.TTFTS <= 0 || ok.LatencyS < ok.TTFTS || ok.UncachedTokens != 900 || ok.GotTokens != 3 {
		t.Fatalf("ok record %+v", ok)
	}
	if ok.PrefillLoadedTokens != 0 {
		t.Fatalf("ok record %+v", ok)
	}
	// P loaded 600 of the 1000 tokens: it computed 400 at most (the decision's 100 cached are
	// within the load).
	if r := by["s-b/0"]; !r.OK || r.PrefillLoadedTokens != 600 || r.UncachedTokens != 400 {
		t.Fatalf("loaded record %+v", r)
	}
	if r := by["s-a/1"]; !r.OK || r.Retries != 1 || fmt.Sprint(r.RetriedFrom) != "[decode-1]" || len(ok.RetriedFrom) != 0 {
		t.Fatalf("retried record %+v", r)
	}
	tests := []struct {
		key, kind, code string
	}{
		{"s-b/1", "REJECTED_BY_D", "no_capacity"},
		{"s-b/2", "WORKER_ERROR", "worker_stream_ended"},
		{"s-a/2", "CONNECTION_ERROR", ""},
	}
	for _, tt := range tests {
		r := by[tt.key]
		if r.OK || r.ErrorKind != tt.kind || r.ErrorCode != tt.code {
			t.Fatalf("%s: %+v", tt.key, r)
		}
	}
	// Turns of a session are sent in order, one after another.
	v, _ := seen.Load("s-a")
	if got := *(v.(*[]int)); fmt.Sprint(got) != "[0 1 2]" {
		t.Fatalf("turn order %v", got)
	}
}

// A resumed request's record names the resume from the gateway's trailers: the dead worker,
// the one that finished it, the continuation attempts and the workers of those retried.
func TestReplayRecordsResume(t *testing.T) {
	gw, _ := fakeGateway(t, func(session string, turn int) string {
		switch {
		case session == "s-a" && turn == 1:
			return "resumed"
		case session == "s-b" && turn == 2:
			return "resumed-retried"
		}
		return ""
	})
	var out bytes.Buffer
	recs, err := Replay(context.Background(), gw.URL, testWorkload(), Options{Arm: "E9", TimeScale: 1, Out: &out})
	if err != nil {
		t.Fatal(err)
	}
	type resume struct {
		from, on string
		attempts int
		retried  string
	}
	want := map[string]resume{"s-a/1": {"decode-0", "decode-2", 1, "[]"}, "s-b/2": {"decode-0", "decode-2", 2, "[decode-3]"}}
	for _, r := range recs {
		key := fmt.Sprintf("%s/%d", r.SessionID, r.Turn)
		w := want[key]
		if w.retried == "" {
			w.retried = "[]"
		}
		got := resume{r.ResumedFrom, r.ResumedOn, r.ResumedAttempts, fmt.Sprint(r.ResumedRetriedFrom)}
		if !r.OK || got != w {
			t.Errorf("%s: ok %v, resume %+v, want %+v", key, r.OK, got, w)
		}
	}
	// The metrics line carries them by their JSON names.
	var line struct {
		Session     string   `json:"session_id"`
		Turn        int      `json:"turn"`
		Attempts    int      `json:"resumed_attempts"`
		RetriedFrom []string `json:"resumed_retried_from"`
	}
	n := 0
	for _, l := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if err := json.Unmarshal([]byte(l), &line); err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		if line.Session == "s-b" && line.Turn == 2 {
			n++
			if line.Attempts != 2 || fmt.Sprint(line.RetriedFrom) != "[decode-3]" {
				t.Fatalf("metrics line %q", l)
			}
		}
	}
	if n != 1 {
		t.Fatalf("%d metrics lines for s-b turn 2", n)
	}
}

func TestReplayGatewayDown(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	recs, err := Replay(context.Background(), "http://"+addr, testWorkload(), Options{Arm: "E9", TimeScale: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 6 {
		t.Fatalf("%d records", len(recs))
	}
	for _, r := range recs {
		if r.OK || r.ErrorKind != "CONNECTION_ERROR" {
			t.Fatalf("%+v", r)
		}
	}
	s := report.Compute("E9", recs, 1).Summary
	if s.OK != 0 || s.Total != 6 {
		t.Fatalf("%+v", s)
	}
}

func TestReplayRejectsBadScale(t *testing.T) {
	if _, err := Replay(context.Background(), "http://127.0.0.1:1", testWorkload(), Options{TimeScale: 0}); err == nil {
		t.Fatal("accepted time scale 0")
	}
}

func TestArmPolicy(t *testing.T) {
	tests := []struct {
		arm       string
		kvc, snap bool
		wantErr   bool
	}{
		{"E1", false, false, false}, {"E3", true, false, false}, {"E4", true, true, false}, {"E2", false, false, true},
	}
	for _, tt := range tests {
		p, err := ArmPolicy(tt.arm)
		if (err != nil) != tt.wantErr {
			t.Fatalf("%s: %v", tt.arm, err)
		}
		if err == nil && (p.GetKvCentricEnabled() != tt.kvc || p.GetSnapshotsEnabled() != tt.snap) {
			t.Fatalf("%s: %v", tt.arm, p)
		}
	}
}

func TestRunAgainstGatewayURL(t *testing.T) {
	gw, _ := fakeGateway(t, func(string, int) string { return "" })
	out := t.TempDir()
	wl := testWorkload()
	arms, err := Run(context.Background(), Config{
		GatewayURL: gw.URL, Arms: []string{"ext"}, OutDir: out, Workload: wl,
		Meta:   report.Meta{Command: "test", Workload: wl.Name, Stats: wl.Describe(), TimeScale: 1},
		Replay: Options{TimeScale: 1}, Log: io.Discard,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(arms) != 1 || arms[0].Summary.OK != 6 || arms[0].Summary.BytesMoved != 6*64 {
		t.Fatalf("%+v", arms[0].Summary)
	}
	for _, f := range []string{report.ReportFile, report.SummaryFile, report.CDFFile, report.ModesFile, "metrics.jsonl"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
}
