package cluster

import (
	"net/http"
	"slices"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A decode worker (kvc-sim, SIGKILLed; its sidecar lives on) dies while a turn streams from it:
// the gateway resumes the request through a new decision without the dead worker, whose prompt
// is the turn's prompt and the ids streamed so far, and the client's one 200 answer ends with
// [DONE] and carries every token asked for — the ids an uninterrupted run of the same turn
// gives (kvc-sim generates a function of the session and the position: the same turn asked
// again, its history rewound, streams the same ids), the resume named in the trailers. A
// second gateway on the same cluster with --resume-mid-stream=false answers the same death as
// before: an error event after the tokens streamed.
func TestResumeAfterDecodeWorkerDeath(t *testing.T) {
	c, ctx := startClusterWithin(t, 4*time.Minute, Config{
		Prefill: 1, Decode: 3, ControlPlanes: 1,
		// 20 ms per token: a 120-token answer streams for seconds, the kill lands mid-stream.
		SimArgs: []string{"--layers", "4", "--bytes-per-token-per-buffer", "16", "--decode-ms-per-token", "20"},
		Policy:  &kvcv1.Policy{SnapshotDeltaTokens: ptr(int64(16))},
	})
	noResume, err := c.StartGateway(ctx, "gateway-noresume", "--resume-mid-stream=false")
	if err != nil {
		t.Fatalf("second gateway: %v", err)
	}

	const maxNew, killAfter = 120, 10
	turn := func(gw, session string, seedLen int) (prompt []int64, victim string, got genResult) {
		p0 := make([]int64, seedLen)
		for i := range p0 {
			p0[i] = int64(200000 + 7*i)
		}
		// The seed turn: the session resident on a decode worker, its snapshot in P's store.
		r := firstTurn(t, c, gw, session, "", request{ids: p0})
		prompt = append(append(p0, r.ids...), 300001, 300002, 300003, 300004)
		got = send(t, gw, session, request{ids: prompt, maxNew: maxNew, afterChunks: killAfter, during: func(h http.Header) {
			victim = h.Get("X-Kvc-Decode-Worker")
			t.Logf("%s: killing %s after %d tokens", session, victim, killAfter)
			if err := c.Kill("sim-" + victim); err != nil {
				t.Fatal(err)
			}
		}})
		if victim == "" {
			t.Fatalf("%s: the stream ended before %d tokens: %+v", session, killAfter, got)
		}
		return prompt, victim, got
	}

	// Resumed.
	prompt, victim, got := turn(c.GatewayURL, "resume-on", 300)
	if got.status != http.StatusOK || !got.done || got.errCode != "" || len(got.ids) != maxNew {
		t.Fatalf("resumed answer: status %d, done %v, error %q, %d ids of %d", got.status, got.done, got.errCode, len(got.ids), maxNew)
	}
	// The continuation's KV (reseeded or prefilled for the prompt and the streamed ids) verified;
	// the counts are the whole answer's.
	if k := got.kvc(); k["verify_failures"] != float64(0) || k["kv_len_after"] != float64(len(prompt)+maxNew) || got.meta["completion_tokens"] != float64(maxNew) {
		t.Fatalf("resumed answer's last meta: completion_tokens %v, kvc %v", got.meta["completion_tokens"], k)
	}
	on := got.trailer.Get("X-Kvc-Resumed-Decode-Worker")
	if got.trailer.Get("X-Kvc-Resumed-From") != victim || on == "" || on == victim {
		t.Fatalf("trailers %v (killed %s)", got.trailer, victim)
	}
	// The uninterrupted run: the same turn again (the session's history rewound to its prompt),
	// on a live worker, without a death.
	again := send(t, c.GatewayURL, "resume-on", request{ids: prompt, maxNew: maxNew})
	if again.status != http.StatusOK || !again.done || again.errCode != "" || again.trailer.Get("X-Kvc-Resumed-From") != "" {
		t.Fatalf("uninterrupted run: %+v", again)
	}
	if !slices.Equal(got.ids, again.ids) {
		t.Fatalf("resumed ids differ from the uninterrupted run's:\n%v\n%v", got.ids, again.ids)
	}
	if n := counter(t, c.GatewayURL, `kvc_gateway_resumes_total{result="ok"}`); n != 1 {
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
	if n := counter(t, noResume, `kvc_gateway_resumes_total{result="disabled"}`); n != 1 {
		t.Fatalf("second gateway's kvc_gateway_resumes_total{disabled} = %v", n)
	}
	t.Logf("resumed on %s; without resume: %s after %d tokens", on, got2.errCode, len(got2.ids))
}
