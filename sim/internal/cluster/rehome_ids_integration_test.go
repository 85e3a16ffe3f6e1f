package cluster

import (
	"bytes"
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

// TestRehomeCarriesTokenIDs (issue 20 item 3 on real SGLang): sessions committed with their
// token ids on a decode worker (kvc-sim commits its content's ids, the turns' input_ids and
// the generated ones) push them to the prefill store with their KV; the worker dies; each
// session is re-homed onto the other decode worker, whose load /generate carries the same ids
// as input_ids (the prefill store's, through SnapshotTokens), and kvc-sim verifies every loaded
// byte against them (no load_unverified); the next turn is DIRECT_TO_D on the loaded KV. On
// the code before, the load carried no input_ids and kvc-sim kept the KV unverified.
func TestRehomeCarriesTokenIDs(t *testing.T) {
	recs := map[string]*loadRecorder{}
	c, ctx := startCluster(t, Config{
		Prefill: 1, Decode: 2, ControlPlanes: 1, Policy: &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))},
		SidecarWorkerURL: func(w Worker) string {
			if w.Role != "decode" {
				return w.WorkerURL
			}
			r := &loadRecorder{loads: map[string]recordedLoad{}}
			recs[w.ID] = r
			return r.proxy(t, w.WorkerURL)
		},
	})

	// Four sessions of real-looking ids (not kvc-sim's made-up ones), one seed turn each.
	ctxIDs := map[string][]int64{} // the session's context: prompt, then the generated ids
	byD := map[string][]string{}
	for i := 0; i < 4; i++ {
		s := fmt.Sprintf("rid-%d", i)
		prompt := make([]int64, 150+10*i)
		for j := range prompt {
			prompt[j] = int64(100000 + 1000*i + j)
		}
		r := firstTurn(t, c, c.GatewayURL, s, "SEED", request{ids: prompt})
		ctxIDs[s] = append(prompt, r.ids...)
		d := r.header.Get("X-Kvc-Decode-Worker")
		byD[d] = append(byD[d], s)
	}
	victim, moved := killMostHeld(t, c, byD)
	waitRehomed(t, ctx, c, victim, moved)

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
		r := send(t, c.GatewayURL, s, request{ids: next})
		km := served(t, s+"'s next turn", r, "DIRECT_TO_D", "")
		if d := r.header.Get("X-Kvc-Decode-Worker"); km["verify_failures"] != float64(0) || d != target {
			t.Fatalf("%s's next turn on %s, want %s, verified: %v", s, d, target, r.meta)
		}
	}
}
