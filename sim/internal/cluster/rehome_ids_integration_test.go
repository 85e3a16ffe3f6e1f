package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// loadRecorder is a reverse proxy in front of a decode worker's API that keeps every load
// call's (rid "load-…") request and answer bodies.
type loadRecorder struct {
	mu    sync.Mutex
	loads map[string]recordedLoad // by session
}

type recordedLoad struct {
	InputIDs []int64
	HasIDs   bool
	Answer   map[string]any
}

func (l *loadRecorder) proxy(t *testing.T, target string) string {
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/generate" {
			rp.ServeHTTP(w, r)
			return
		}
		body, _ := io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(body))
		var req struct {
			RID           string          `json:"rid"`
			InputIDs      json.RawMessage `json:"input_ids"`
			SessionParams struct {
				ID string `json:"id"`
			} `json:"session_params"`
		}
		if json.Unmarshal(body, &req) != nil || !strings.HasPrefix(req.RID, "load-") {
			rp.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		rp.ServeHTTP(rec, r)
		ld := recordedLoad{HasIDs: len(req.InputIDs) > 0}
		_ = json.Unmarshal(req.InputIDs, &ld.InputIDs)
		_ = json.Unmarshal(rec.Body.Bytes(), &ld.Answer)
		l.mu.Lock()
		l.loads[req.SessionParams.ID] = ld
		l.mu.Unlock()
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		_, _ = w.Write(rec.Body.Bytes())
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func (l *loadRecorder) get(session string) (recordedLoad, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ld, ok := l.loads[session]
	return ld, ok
}

// generateIDs sends one streaming /generate with input_ids through the gateway and returns the
// answer with every generated id.
func generateIDs(t *testing.T, gw, session string, ids []int64) (genResult, []int64) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{
		"input_ids": ids, "stream": true, "session_params": map[string]any{"id": session},
		"sampling_params": map[string]any{"max_new_tokens": 8},
	})
	req, _ := http.NewRequest(http.MethodPost, gw+"/generate", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("generate: %v", err)
	}
	defer resp.Body.Close()
	r := genResult{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		r.body = string(raw)
		return r, nil
	}
	var out []int64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			OutputIDs []int64        `json:"output_ids"`
			MetaInfo  map[string]any `json:"meta_info"`
		}
		if json.Unmarshal([]byte(data), &chunk) == nil {
			out = append(out, chunk.OutputIDs...) // kvc-sim streams each chunk's own ids
			if chunk.MetaInfo != nil {
				r.meta = chunk.MetaInfo
			}
		}
		r.body += data + "\n"
	}
	return r, out
}

// TestRehomeCarriesTokenIDs (issue 20 item 3 on real SGLang): sessions committed with their
// token ids on a decode worker (kvc-sim commits its content's ids, the turns' input_ids and
// the generated ones) push them to the prefill store with their KV; the worker dies; each
// session is re-homed onto the other decode worker, whose load /generate carries the same ids
// as input_ids (the prefill store's, through SnapshotTokens), and kvc-sim verifies every loaded
// byte against them (no load_unverified); the next turn is DIRECT_TO_D on the loaded KV. On
// the code before, the load carried no input_ids and kvc-sim kept the KV unverified.
func TestRehomeCarriesTokenIDs(t *testing.T) {
	dir := binDir(t)
	work := t.TempDir()
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	recs := map[string]*loadRecorder{}
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: work, Prefill: 1, Decode: 2, ControlPlanes: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 16384, PrefillCapacityTokens: 65536,
		SimArgs: []string{"--time-scale", "0.05", "--layers", "4", "--bytes-per-token-per-buffer", "16"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))},
		SidecarWorkerURL: func(w Worker) string {
			if w.Role != "decode" {
				return w.WorkerURL
			}
			r := &loadRecorder{loads: map[string]recordedLoad{}}
			recs[w.ID] = r
			return r.proxy(t, w.WorkerURL)
		},
	})
	if err != nil {
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	defer func() { _ = c.Stop() }()

	// Four sessions of real-looking ids (not kvc-sim's made-up ones), one seed turn each.
	ctxIDs := map[string][]int64{} // the session's context: prompt, then the generated ids
	byD := map[string][]string{}
	for i := 0; i < 4; i++ {
		s := fmt.Sprintf("rid-%d", i)
		prompt := make([]int64, 150+10*i)
		for j := range prompt {
			prompt[j] = int64(100000 + 1000*i + j)
		}
		r, out := generateIDs(t, c.GatewayURL, s, prompt)
		if r.status != http.StatusOK || r.header.Get("X-Kvc-Mode") != "SEED" {
			t.Fatalf("%s: %d %s %s\n%s", s, r.status, r.header.Get("X-Kvc-Mode"), r.body, logs(c))
		}
		ctxIDs[s] = append(prompt, out...)
		d := r.header.Get("X-Kvc-Decode-Worker")
		byD[d] = append(byD[d], s)
		waitSnapshot(t, c, s, int64(r.meta["kvc"].(map[string]any)["kv_len_after"].(float64)))
	}
	victim := ""
	for d, ss := range byD {
		if victim == "" || len(ss) > len(byD[victim]) || (len(ss) == len(byD[victim]) && d < victim) {
			victim = d
		}
	}
	moved := byD[victim]
	t.Logf("killing %s, which holds %v", victim, moved)
	if err := c.Kill("sim-" + victim); err != nil {
		t.Fatal(err)
	}
	if err := c.retry(ctx, "sessions re-homed", func(ctx context.Context) error {
		return c.onLeader(ctx, func(ctx context.Context, cl kvcv1.AdminServiceClient) error {
			for _, s := range moved {
				resp, err := cl.GetSession(ctx, &kvcv1.GetSessionRequest{SessionId: s})
				if err != nil {
					return err
				}
				rec := resp.GetSession()
				if d := rec.GetDecodeWorker(); d == "" || d == victim || rec.GetKvCommittedLen() < rec.GetSnapshot().GetSeqlen() {
					return errNotYet
				}
			}
			return nil
		})
	}); err != nil {
		t.Fatalf("%v\n%s", err, logs(c))
	}

	for _, s := range moved {
		var target string
		for id := range recs {
			if id != victim {
				target = id
			}
		}
		ld, ok := recs[target].get(s)
		if !ok {
			t.Fatalf("%s: no load /generate reached %s", s, target)
		}
		if !ld.HasIDs || len(ld.InputIDs) == 0 || len(ld.InputIDs) > len(ctxIDs[s]) || !slices.Equal(ld.InputIDs, ctxIDs[s][:len(ld.InputIDs)]) {
			t.Fatalf("%s: the load's input_ids (%d, sent %v) are not the session's context's first ids (%d)\n%v",
				s, len(ld.InputIDs), ld.HasIDs, len(ctxIDs[s]), ld.InputIDs)
		}
		meta, _ := ld.Answer["meta_info"].(map[string]any)
		k, _ := meta["kvc"].(map[string]any)
		if k == nil || k["load_unverified"] == true || k["verify_failures"] != float64(0) || k["verified_bytes"] == float64(0) ||
			k["kv_len_after"] != float64(len(ld.InputIDs)) {
			t.Fatalf("%s: the load's answer %v: want every loaded byte verified against its %d ids", s, ld.Answer, len(ld.InputIDs))
		}
		// The next turn finds it resident on the loaded KV.
		next := append(slices.Clone(ctxIDs[s]), 7, 8, 9, 10)
		r, _ := generateIDs(t, c.GatewayURL, s, next)
		km, _ := r.meta["kvc"].(map[string]any)
		if r.status != http.StatusOK || km == nil || km["verify_failures"] != float64(0) {
			t.Fatalf("%s after the kill: %d %s %v\n%s", s, r.status, r.body, r.meta, logs(c))
		}
		if m, d := r.header.Get("X-Kvc-Mode"), r.header.Get("X-Kvc-Decode-Worker"); m != "DIRECT_TO_D" || d != target {
			t.Fatalf("%s's next turn ran as %s (%s) on %s, want DIRECT_TO_D on %s", s, m, r.header.Get("X-Kvc-Reason"), d, target)
		}
	}
}
