package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/clustertest"
)

// The integration tests' one cluster fixture: startCluster starts the real processes, waits for
// every worker READY, captures the cluster's log, and stops it all when the test ends (the log
// and every process's tail logged when the test failed). The helpers below speak to it.

// The kvc-sim model of most tests: 4 layers of 16 bytes per token per buffer (K and V), at 1/20
// of the model's time.
const simLayers, simBytesPerTokenPerBuffer = 4, 16

var fastSim = []string{"--time-scale", "0.05", "--layers", strconv.Itoa(simLayers),
	"--bytes-per-token-per-buffer", strconv.Itoa(simBytesPerTokenPerBuffer)}

// startCluster is startClusterWithin a budget of 3 minutes.
func startCluster(t *testing.T, cfg Config) (*Cluster, context.Context) {
	t.Helper()
	return startClusterWithin(t, 3*time.Minute, cfg)
}

// startClusterWithin starts a cluster with a gateway of cfg's shape, capacities, flags and policy
// and returns it with the test's context (done after budget). What cfg leaves zero: the built
// binaries (clustertest.BinDir), a work dir of the test's ($CLUSTER_IT_WORKDIR/<test> when set,
// kept for a post-mortem), kvc-sim's fastSim model, decode pools of 16,384 tokens and prefill
// pools of 65,536, and the cluster's defaults (1 prefill, 3 decode, 2 control planes).
func startClusterWithin(t *testing.T, budget time.Duration, cfg Config) (*Cluster, context.Context) {
	t.Helper()
	cfg.BinDir = clustertest.BinDir(t, Binaries)
	cfg.WorkDir = t.TempDir()
	if d := os.Getenv("CLUSTER_IT_WORKDIR"); d != "" {
		cfg.WorkDir = filepath.Join(d, t.Name())
	}
	cfg.Gateway = true
	if cfg.SimArgs == nil {
		cfg.SimArgs = fastSim
	}
	if cfg.DecodeCapacityTokens == 0 {
		cfg.DecodeCapacityTokens = 16384
	}
	if cfg.PrefillCapacityTokens == 0 {
		cfg.PrefillCapacityTokens = 65536
	}
	var log strings.Builder
	cfg.Log = &log
	ctx, cancel := context.WithTimeout(t.Context(), budget)
	c, err := Start(ctx, cfg)
	if err != nil {
		cancel()
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	t.Cleanup(func() {
		cancel()
		if t.Failed() {
			t.Logf("cluster log:\n%s\n%s", log.String(), logs(c))
		}
		if err := c.Stop(); err != nil {
			t.Logf("stop: %v", err)
		}
	})
	return c, ctx
}

// logs is the last lines of every process's log.
func logs(c *Cluster) string {
	var b strings.Builder
	for _, p := range c.Processes {
		b.WriteString("== " + p.Name + "\n" + p.Tail(15) + "\n")
	}
	return b.String()
}

type notYet struct{}

func (notYet) Error() string { return "not yet" }

var errNotYet = notYet{}

func ptr[T any](v T) *T { return &v }

// request is one streamed /generate: text or input ids, max_new_tokens (8 when 0), and during,
// when set, called once after the afterChunks-th chunk with the stream still open.
type request struct {
	text        string
	ids         []int64
	maxNew      int
	ignoreEOS   bool
	afterChunks int
	during      func(h http.Header)
}

// genResult is a streamed /generate answer as a client reads it.
type genResult struct {
	status  int
	header  http.Header
	trailer http.Header
	body    string         // the answer when not 200, else every data line
	meta    map[string]any // the last chunk's meta_info
	ids     []int64        // every chunk's output_ids (kvc-sim streams each chunk's own)
	errCode string         // a mid-stream error event's code
	done    bool           // [DONE] came
}

// kvc is the answer's meta_info.kvc (nil when none).
func (r genResult) kvc() map[string]any {
	k, _ := r.meta["kvc"].(map[string]any)
	return k
}

// kvLenAfter is the tokens the answer's decode worker holds for the session after it.
func (r genResult) kvLenAfter() int64 {
	f, _ := r.kvc()["kv_len_after"].(float64)
	return int64(f)
}

// send streams one /generate of session through the gateway at gw and reads the answer.
func send(t *testing.T, gw, session string, rq request) genResult {
	t.Helper()
	if rq.maxNew == 0 {
		rq.maxNew = 8
	}
	sampling := map[string]any{"max_new_tokens": rq.maxNew}
	if rq.ignoreEOS {
		sampling["ignore_eos"] = true
	}
	body := map[string]any{"stream": true, "session_params": map[string]any{"id": session}, "sampling_params": sampling}
	if rq.ids != nil {
		body["input_ids"] = rq.ids
	} else {
		body["text"] = rq.text
	}
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest(http.MethodPost, gw+"/generate", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := (&http.Client{Timeout: 90 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("generate: %v", err)
	}
	defer resp.Body.Close()
	r := genResult{status: resp.StatusCode, header: resp.Header}
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		r.body = string(raw)
		return r
	}
	br := bufio.NewReader(resp.Body)
	chunks := 0
	for {
		line, err := br.ReadString('\n')
		if data, ok := strings.CutPrefix(strings.TrimSpace(line), "data: "); ok {
			if data == "[DONE]" {
				r.done = true
				_, _ = io.Copy(io.Discard, br) // to the trailers
				break
			}
			r.body += data + "\n"
			var c struct {
				OutputIDs json.RawMessage `json:"output_ids"`
				MetaInfo  map[string]any  `json:"meta_info"`
				Error     *struct {
					Code string `json:"code"`
				} `json:"error"`
			}
			if json.Unmarshal([]byte(data), &c) == nil {
				if c.Error != nil {
					r.errCode = c.Error.Code
				}
				var ids []int64
				if json.Unmarshal(c.OutputIDs, &ids) == nil {
					r.ids = append(r.ids, ids...)
				}
				if c.MetaInfo != nil {
					r.meta = c.MetaInfo
				}
			}
			if chunks++; chunks == rq.afterChunks && rq.during != nil {
				rq.during(resp.Header)
			}
		}
		if err != nil {
			break
		}
	}
	r.trailer = resp.Trailer
	return r
}

// generate is send of text with 8 new tokens.
func generate(t *testing.T, gw, session, text string) genResult {
	t.Helper()
	return send(t, gw, session, request{text: text})
}

// served fails the test unless r is a 200 answer with meta_info.kvc, run as mode ("": any) for
// reason ("": any); it returns the kvc.
func served(t *testing.T, what string, r genResult, mode, reason string) map[string]any {
	t.Helper()
	m, why := r.header.Get("X-Kvc-Mode"), r.header.Get("X-Kvc-Reason")
	if r.status != http.StatusOK || r.kvc() == nil || (mode != "" && m != mode) || (reason != "" && why != reason) {
		t.Fatalf("%s: %d %s (%s), want %q (%q): %s", what, r.status, m, why, mode, reason, r.body)
	}
	return r.kvc()
}

// firstTurn is a session's first turn: served as mode ("": any), its snapshot then in the
// prefill store.
func firstTurn(t *testing.T, c *Cluster, gw, session, mode string, rq request) genResult {
	t.Helper()
	r := send(t, gw, session, rq)
	served(t, session+"'s first turn", r, mode, "")
	waitSnapshot(t, c, session, r.kvLenAfter())
	return r
}

// killMostHeld SIGKILLs the kvc-sim of the decode worker holding the most of byD's sessions (the
// first by id of a tie) and returns that worker and its sessions.
func killMostHeld(t *testing.T, c *Cluster, byD map[string][]string) (victim string, moved []string) {
	t.Helper()
	for d, ss := range byD {
		if victim == "" || len(ss) > len(byD[victim]) || (len(ss) == len(byD[victim]) && d < victim) {
			victim = d
		}
	}
	t.Logf("killing %s, which holds %v", victim, byD[victim])
	if err := c.Kill("sim-" + victim); err != nil {
		t.Fatal(err)
	}
	return victim, byD[victim]
}

// waitRehomed waits until each of sessions is resident, on its whole snapshot, on a decode
// worker other than victim.
func waitRehomed(t *testing.T, ctx context.Context, c *Cluster, victim string, sessions []string) {
	t.Helper()
	if err := c.retry(ctx, "sessions re-homed", func(ctx context.Context) error {
		return c.onLeader(ctx, func(ctx context.Context, cl kvcv1.AdminServiceClient) error {
			for _, s := range sessions {
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
		t.Fatal(err)
	}
}

// prefillWorker is the cluster's (first) prefill worker.
func prefillWorker(t *testing.T, c *Cluster) Worker {
	t.Helper()
	for _, w := range c.Workers {
		if w.Role == "prefill" {
			return w
		}
	}
	t.Fatal("no prefill worker")
	return Worker{}
}

// waitSnapshot waits until the prefill sidecar's snapshot of session covers seqlen tokens.
func waitSnapshot(t *testing.T, c *Cluster, session string, seqlen int64) {
	t.Helper()
	url := prefillWorker(t, c).SidecarHTTP + "/v1/sessions/" + session + "/snapshot_status"
	var last string
	waitFor(t, func() bool {
		resp, err := http.Get(url)
		if err != nil {
			last = err.Error()
			return false
		}
		defer resp.Body.Close()
		var st struct {
			Exists bool  `json:"exists"`
			Seqlen int64 `json:"seqlen"`
		}
		b, _ := io.ReadAll(resp.Body)
		last = string(b)
		return json.Unmarshal(b, &st) == nil && st.Exists && st.Seqlen == seqlen
	}, func() string {
		return fmt.Sprintf("snapshot of %s never reached %d tokens; last status %s", session, seqlen, last)
	})
}

// waitFor is waitWithin 30 s.
func waitFor(t *testing.T, cond func() bool, why func() string) {
	t.Helper()
	waitWithin(t, 30*time.Second, cond, why)
}

// waitWithin fails the test with why() unless cond holds within d (polled every 20 ms: it reads
// what other processes show).
func waitWithin(t *testing.T, d time.Duration, cond func() bool, why func() string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	defer cancel()
	if launch.WaitFor(ctx, nil, 20*time.Millisecond, cond) != nil {
		t.Fatal(why())
	}
}

// samples sums the samples of series on url's /metrics — every label set of a bare name, or the
// one series named with its labels — and counts them.
func samples(t *testing.T, url, series string) (sum float64, n int) {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	bare := !strings.Contains(series, "{")
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, series+" ") && !(bare && strings.HasPrefix(line, series+"{")) {
			continue
		}
		f, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		if err != nil {
			t.Fatalf("%s/metrics: %q: %v", url, line, err)
		}
		sum += f
		n++
	}
	return sum, n
}

// counter is samples' sum (0 when url shows no such series).
func counter(t *testing.T, url, series string) float64 {
	t.Helper()
	sum, _ := samples(t, url, series)
	return sum
}

// shownCounter is samples' sum; the test fails when url shows no such series.
func shownCounter(t *testing.T, url, series string) float64 {
	t.Helper()
	sum, n := samples(t, url, series)
	if n == 0 {
		t.Fatalf("%s not in %s/metrics", series, url)
	}
	return sum
}
