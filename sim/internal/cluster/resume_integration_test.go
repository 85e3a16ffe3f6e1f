package cluster

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// streamResult is a streamed /generate answer as a client reads it.
type streamResult struct {
	status  int
	header  http.Header
	trailer http.Header
	ids     []int64        // every chunk's output_ids (kvc-sim streams each chunk's own)
	errCode string         // a mid-stream error event's code
	done    bool           // [DONE] came
	kvc     map[string]any // the last chunk's meta_info.kvc
	tokens  float64        // the last chunk's meta_info.completion_tokens
	body    string
}

// streamIDs sends a streaming /generate of ids through gw and reads the answer; after the
// afterChunks-th chunk (> 0) it calls during once, the stream still open.
func streamIDs(t *testing.T, gw, session string, ids []int64, maxNew int, afterChunks int, during func(h http.Header)) streamResult {
	t.Helper()
	b, _ := json.Marshal(map[string]any{
		"input_ids": ids, "stream": true, "session_params": map[string]any{"id": session},
		"sampling_params": map[string]any{"max_new_tokens": maxNew},
	})
	req, _ := http.NewRequest(http.MethodPost, gw+"/generate", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := (&http.Client{Timeout: 90 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("generate: %v", err)
	}
	defer resp.Body.Close()
	r := streamResult{status: resp.StatusCode, header: resp.Header}
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
			var c struct {
				OutputIDs []int64 `json:"output_ids"`
				MetaInfo  *struct {
					CompletionTokens float64        `json:"completion_tokens"`
					KVC              map[string]any `json:"kvc"`
				} `json:"meta_info"`
				Error *struct {
					Code string `json:"code"`
				} `json:"error"`
			}
			if json.Unmarshal([]byte(data), &c) == nil {
				if c.Error != nil {
					r.errCode = c.Error.Code
				}
				r.ids = append(r.ids, c.OutputIDs...)
				if c.MetaInfo != nil {
					r.kvc, r.tokens = c.MetaInfo.KVC, c.MetaInfo.CompletionTokens
				}
			}
			if chunks++; chunks == afterChunks && during != nil {
				during(resp.Header)
			}
		}
		if err != nil {
			break
		}
	}
	r.trailer = resp.Trailer
	return r
}

// A decode worker (kvc-sim, SIGKILLed; its sidecar lives on) dies while a turn streams from it:
// the gateway resumes the request through a new decision without the dead worker, whose prompt
// is the turn's prompt and the ids streamed so far, and the client's one 200 answer ends with
// [DONE] and carries every token asked for — the ids an uninterrupted run of the same turn
// gives (kvc-sim generates a function of the session and the position: the same turn asked
// again, its history rewound, streams the same ids), the resume named in the trailers. A
// second gateway on the same cluster with --resume-mid-stream=false answers the same death as
// before: an error event after the tokens streamed.
func TestResumeAfterDecodeWorkerDeath(t *testing.T) {
	dir := binDir(t)
	work := t.TempDir()
	if d := os.Getenv("CLUSTER_IT_WORKDIR"); d != "" {
		work = d
	}
	var log strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c, err := Start(ctx, Config{
		BinDir: dir, WorkDir: work, Prefill: 1, Decode: 3, ControlPlanes: 1, Gateway: true, Log: &log,
		DecodeCapacityTokens: 16384, PrefillCapacityTokens: 65536,
		// 20 ms per token: a 120-token answer streams for seconds, the kill lands mid-stream.
		SimArgs: []string{"--layers", "4", "--bytes-per-token-per-buffer", "16", "--decode-ms-per-token", "20"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))},
	})
	if err != nil {
		t.Fatalf("start: %v\n%s", err, log.String())
	}
	defer func() { _ = c.Stop() }()
	noResume, err := c.StartGateway(ctx, "gateway-noresume", "--resume-mid-stream=false")
	if err != nil {
		t.Fatalf("second gateway: %v\n%s", err, logs(c))
	}

	const maxNew, killAfter = 120, 10
	turn := func(gw, session string, seedLen int) (prompt []int64, victim string, got streamResult) {
		p0 := make([]int64, seedLen)
		for i := range p0 {
			p0[i] = int64(200000 + 7*i)
		}
		// The seed turn: the session resident on a decode worker, its snapshot in P's store.
		r, out := generateIDs(t, gw, session, p0)
		if r.status != http.StatusOK {
			t.Fatalf("%s seed: %d %s\n%s", session, r.status, r.body, logs(c))
		}
		waitSnapshot(t, c, session, int64(r.meta["kvc"].(map[string]any)["kv_len_after"].(float64)))
		prompt = append(append(p0, out...), 300001, 300002, 300003, 300004)
		got = streamIDs(t, gw, session, prompt, maxNew, killAfter, func(h http.Header) {
			victim = h.Get("X-Kvc-Decode-Worker")
			t.Logf("%s: killing %s after %d tokens", session, victim, killAfter)
			if err := c.Kill("sim-" + victim); err != nil {
				t.Fatal(err)
			}
		})
		if victim == "" {
			t.Fatalf("%s: the stream ended before %d tokens: %+v", session, killAfter, got)
		}
		return prompt, victim, got
	}

	// Resumed.
	prompt, victim, got := turn(c.GatewayURL, "resume-on", 300)
	if got.status != http.StatusOK || !got.done || got.errCode != "" || len(got.ids) != maxNew {
		t.Fatalf("resumed answer: status %d, done %v, error %q, %d ids of %d\n%s", got.status, got.done, got.errCode, len(got.ids), maxNew, logs(c))
	}
	// The continuation's KV (reseeded or prefilled for the prompt and the streamed ids) verified;
	// the counts are the whole answer's.
	if got.kvc["verify_failures"] != float64(0) || got.kvc["kv_len_after"] != float64(len(prompt)+maxNew) || got.tokens != maxNew {
		t.Fatalf("resumed answer's last meta: completion_tokens %v, kvc %v", got.tokens, got.kvc)
	}
	on := got.trailer.Get("X-Kvc-Resumed-Decode-Worker")
	if got.trailer.Get("X-Kvc-Resumed-From") != victim || on == "" || on == victim {
		t.Fatalf("trailers %v (killed %s)", got.trailer, victim)
	}
	// The uninterrupted run: the same turn again (the session's history rewound to its prompt),
	// on a live worker, without a death.
	again := streamIDs(t, c.GatewayURL, "resume-on", prompt, maxNew, 0, nil)
	if again.status != http.StatusOK || !again.done || again.errCode != "" || again.trailer.Get("X-Kvc-Resumed-From") != "" {
		t.Fatalf("uninterrupted run: %+v\n%s", again, logs(c))
	}
	if !slices.Equal(got.ids, again.ids) {
		t.Fatalf("resumed ids differ from the uninterrupted run's:\n%v\n%v", got.ids, again.ids)
	}
	if n := sumCounter(t, c.GatewayURL, `kvc_gateway_resumes_total{result="ok"}`); n != 1 {
		t.Fatalf("kvc_gateway_resumes_total{ok} = %v", n)
	}

	// Not resumed: the old failure.
	_, victim2, got2 := turn(noResume, "resume-off", 280)
	if victim2 == victim {
		t.Fatalf("the second turn ran on the dead worker %s", victim)
	}
	if got2.status != http.StatusOK || got2.errCode == "" || len(got2.ids) >= maxNew || got2.trailer.Get("X-Kvc-Resumed-From") != "" {
		t.Fatalf("without resume: status %d, error %q, %d ids, trailers %v; want the worker's error mid-stream", got2.status, got2.errCode, len(got2.ids), got2.trailer)
	}
	if n := sumCounter(t, noResume, `kvc_gateway_resumes_total{result="disabled"}`); n != 1 {
		t.Fatalf("second gateway's kvc_gateway_resumes_total{disabled} = %v", n)
	}
	t.Logf("resumed on %s; without resume: %s after %d tokens", on, got2.errCode, len(got2.ids))
}
