package server

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// FuzzDecodeStream feeds arbitrary worker answers (an untrusted stream) through the decode path:
// nothing may panic, and every result is either a success or carries an error kind.
func FuzzDecodeStream(f *testing.F) {
	f.Add("data: {\"text\":\"a\",\"meta_info\":{\"completion_tokens\":1}}\n\ndata: [DONE]\n\n", true)
	f.Add("data: {\"error\":{\"code\":\"kv_verify_failed\",\"message\":\"x\"}}\n\n", true)
	f.Add("data: not json\n\n", true)
	f.Add("data: {\"text\":5}\n", true)
	f.Add("{\"text\":\"whole\",\"meta_info\":{\"kvc\":{\"kv_len_after\":9}}}", false)
	f.Add("", true)
	f.Add("data:\n\ndata: [DONE]", true)
	f.Fuzz(func(t *testing.T, body string, sse bool) {
		w := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if sse {
				w.Header().Set("Content-Type", "text/event-stream")
			} else {
				w.Header().Set("Content-Type", "application/json")
			}
			_, _ = w.Write([]byte(body))
		}))
		defer w.Close()
		s := New(nil, nil, Options{RequestTimeout: 5 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20}, zerolog.Nop(), NewMetrics(prometheus.NewRegistry()))
		defer s.Close()
		req := &api.Request{Kind: api.Chat, RID: "r", SessionID: "s", InputTokens: 10, MaxTokens: 4, Stream: true}
		p := &plan{mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, decode: &kvcv1.WorkerRef{WorkerUrl: w.URL}}
		rec := httptest.NewRecorder()
		res := s.execute(context.Background(), context.Background(), time.Now(), p, req, newSink(rec, req))
		if !res.ok && res.kind == kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_UNSPECIFIED {
			t.Fatalf("failure without a kind: %+v", res)
		}
	})
}
