package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvcentric/kvcentric/sim/internal/clustertest"
)

// repoFile is a file of the repository, found from this package's folder.
func repoFile(t *testing.T, rel string) string {
	t.Helper()
	p, err := filepath.Abs(filepath.Join("..", "..", "..", rel))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("%s: %v", rel, err)
	}
	return p
}

// kvcMetric matches the kvcentric metric names an expression or rule file refers to.
var kvcMetric = regexp.MustCompile(`\bkvc_[a-z0-9_]+\b`)

// dashboardMetrics is every kvc_ metric the dashboard's panels query (each panel must query one).
func dashboardMetrics(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	var out []string
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		n := 0
		for _, tg := range p.Targets {
			ms := kvcMetric.FindAllString(tg.Expr, -1)
			n += len(ms)
			out = append(out, ms...)
		}
		if n == 0 {
			t.Errorf("dashboard panel %q queries no kvc_ metric", p.Title)
		}
	}
	if len(out) == 0 {
		t.Fatalf("%s: no metrics found", path)
	}
	return out
}

// ruleMetrics is every kvc_ metric named in the alert rules file (expressions and text alike).
func ruleMetrics(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	out := kvcMetric.FindAllString(string(b), -1)
	if len(out) == 0 {
		t.Fatalf("%s: no metrics found", path)
	}
	return out
}

// scrape returns the sample names a /metrics page exposes: each family's name, plus _bucket, _sum
// and _count of histograms and _sum and _count of summaries.
func scrape(t *testing.T, url string) map[string]bool {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	out := map[string]bool{}
	for name, f := range fams {
		out[name] = true
		switch f.GetType() {
		case dto.MetricType_HISTOGRAM:
			out[name+"_bucket"], out[name+"_sum"], out[name+"_count"] = true, true, true
		case dto.MetricType_SUMMARY:
			out[name+"_sum"], out[name+"_count"] = true, true
		}
	}
	return out
}

// gatewayAPI loads gateway/openapi.yaml (validated as an OpenAPI 3 document) and its router for
// the gateway at base.
func gatewayAPI(t *testing.T, base string) (*openapi3.T, routers.Router) {
	t.Helper()
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromFile(repoFile(t, "gateway/openapi.yaml"))
	if err != nil {
		t.Fatalf("gateway/openapi.yaml: %v", err)
	}
	if err := doc.Validate(loader.Context); err != nil {
		t.Fatalf("gateway/openapi.yaml is not a valid OpenAPI 3 document: %v", err)
	}
	doc.Servers = openapi3.Servers{{URL: base}}
	r, err := legacy.NewRouter(doc)
	if err != nil {
		t.Fatal(err)
	}
	return doc, r
}

func init() {
	// Streams are checked as text (the schema's pattern: they end with data: [DONE]).
	openapi3filter.RegisterBodyDecoder("text/event-stream", openapi3filter.PlainBodyDecoder)
}

// call sends one request to the gateway and validates the request and the real answer against
// the OpenAPI document; it returns the answer's status and body.
func call(t *testing.T, r routers.Router, base, method, path string, hdr map[string]string, body string) (int, http.Header, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, err := http.NewRequest(method, base+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	route, params, err := r.FindRoute(req)
	if err != nil {
		t.Fatalf("%s %s: not in gateway/openapi.yaml: %v", method, path, err)
	}
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route,
		Options: &openapi3filter.Options{MultiError: true}}
	if err := openapi3filter.ValidateRequest(context.Background(), in); err != nil {
		t.Fatalf("%s %s: the test's request does not follow gateway/openapi.yaml: %v", method, path, err)
	}
	if body != "" {
		req.Body = io.NopCloser(strings.NewReader(body)) // ValidateRequest read it
	}
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
		Options: &openapi3filter.Options{MultiError: true, IncludeResponseStatus: true}}
	out.SetBodyBytes(got)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		t.Errorf("%s %s: the gateway's answer (%d %s) does not follow gateway/openapi.yaml: %v\n%s", method, path, resp.StatusCode,
			resp.Header.Get("Content-Type"), err, truncate(got, 600))
	}
	return resp.StatusCode, resp.Header, got
}

func truncate(b []byte, n int) string {
	if len(b) > n {
		return string(b[:n]) + "…"
	}
	return string(b)
}

// TestOperatorFiles runs a real cluster (control plane, both sidecars, kvc-sims, gateway), sends
// every route of the gateway real requests, and checks the operator's files against it:
//   - gateway/openapi.yaml: every answer (success, stream, error, probe) validates against it;
//   - deploy/grafana/kvcentric.json and deploy/prometheus/kvc-alerts.yml: every kvc_ metric they
//     name is on some binary's /metrics.
func TestOperatorFiles(t *testing.T) {
	gatewayAPI(t, "http://127.0.0.1:8080") // the document is valid before anything starts
	c, ctx := startCluster(t, Config{
		Prefill: 1, Decode: 1, ControlPlanes: 1, DecodeCapacityTokens: 4096, PrefillCapacityTokens: 16384,
		SimArgs: []string{"--time-scale", "0.05", "--layers", "2", "--bytes-per-token-per-buffer", "16"},
	})
	if err := c.WaitGatewayConnected(ctx); err != nil {
		t.Fatal(err)
	}
	gw := c.GatewayURL
	_, router := gatewayAPI(t, gw)
	text := strings.Repeat("lorem ipsum ", 60)

	// The client API, through the control plane: a seed, then the session direct on its decode
	// worker; streams and whole answers of each API.
	for i, tc := range []struct {
		path, body string
		stream     bool
	}{
		{"/generate", `{"text":"` + text + `","sampling_params":{"max_new_tokens":4}}`, false},
		{"/generate", `{"text":"` + text + ` more","sampling_params":{"max_new_tokens":4},"stream":true}`, true},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"` + text + `"}],"max_tokens":4}`, false},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"` + text + `"},{"role":"assistant","content":"ok"},{"role":"user","content":"again"}],"max_tokens":4,"stream":true}`, true},
		{"/v1/completions", `{"model":"m","prompt":"` + text + `","max_tokens":4}`, false},
		{"/v1/completions", `{"model":"m","prompt":"` + text + ` and more","max_tokens":4,"stream":true}`, true},
	} {
		sess := fmt.Sprintf("op-%d", i/2)
		code, h, body := call(t, router, gw, http.MethodPost, tc.path, map[string]string{"X-Session-ID": sess}, tc.body)
		if code != http.StatusOK {
			t.Fatalf("%s: %d %s", tc.path, code, body)
		}
		if ct := h.Get("Content-Type"); strings.HasPrefix(ct, "text/event-stream") != tc.stream {
			t.Fatalf("%s stream=%v answered %s", tc.path, tc.stream, ct)
		}
	}
	// Errors with their stable codes.
	for _, tc := range []struct {
		path, body string
		hdr        map[string]string
		code       int
	}{
		{"/generate", `{"text":"no session","sampling_params":{"max_new_tokens":4}}`, nil, http.StatusBadRequest},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`, map[string]string{"X-Session-ID": "op-err", "X-KVC-Pin-Ms": "-5"}, http.StatusBadRequest},
		{"/v1/completions", `{"prompt":"x","max_tokens":0}`, map[string]string{"X-Session-ID": "op-err"}, http.StatusBadRequest},
	} {
		hdr := tc.hdr
		if got, _, body := callRaw(t, router, gw, tc.path, hdr, tc.body); got != tc.code {
			t.Fatalf("%s: %d %s, want %d", tc.path, got, body, tc.code)
		}
	}
	if code, _, body := call(t, router, gw, http.MethodPost, "/close_session", nil, `{"session_id":"op-0"}`); code != http.StatusOK {
		t.Fatalf("close_session: %d %s", code, body)
	}
	for _, p := range []string{"/health", "/healthz", "/readyz", "/metrics"} {
		if code, _, body := call(t, router, gw, http.MethodGet, p, nil, ""); code != http.StatusOK {
			t.Fatalf("GET %s: %d %s", p, code, body)
		}
	}

	// Every binary's /metrics, once the traffic above has been counted everywhere.
	have := map[string]bool{}
	var where []string
	for _, p := range c.Processes {
		addr := p.ReadyString("http_addr")
		if addr == "" || p.Role == "sim" || strings.HasPrefix(p.Name, "sim-") {
			continue
		}
		for name := range scrape(t, "http://"+addr+"/metrics") {
			have[name] = true
		}
		where = append(where, p.Name)
	}
	for _, role := range []string{"controlplane", "gateway", "sidecar-prefill", "sidecar-decode"} {
		if !slices.ContainsFunc(c.Processes, func(p *Process) bool { return p.Role == role || strings.HasPrefix(p.Name, role) }) {
			t.Fatalf("no %s process in the cluster (%v)", role, where)
		}
	}
	check := func(file string, names []string) {
		var missing []string
		for _, n := range names {
			if !have[n] && !slices.Contains(missing, n) {
				missing = append(missing, n)
			}
		}
		sort.Strings(missing)
		if len(missing) > 0 {
			t.Errorf("%s names metrics no running binary exposes (scraped %v): %v", file, where, missing)
		}
	}
	check("deploy/grafana/kvcentric.json", dashboardMetrics(t, repoFile(t, "deploy/grafana/kvcentric.json")))
	check("deploy/prometheus/kvc-alerts.yml", ruleMetrics(t, repoFile(t, "deploy/prometheus/kvc-alerts.yml")))
}

// callRaw is call for an error answer (the request may break the document's request rules on
// purpose: only the answer is validated).
func callRaw(t *testing.T, r routers.Router, base, path string, hdr map[string]string, body string) (int, http.Header, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	route, params, err := r.FindRoute(req)
	if err != nil {
		t.Fatalf("%s: not in gateway/openapi.yaml: %v", path, err)
	}
	resp, err := (&http.Client{Timeout: 60 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	in := &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route}
	out := &openapi3filter.ResponseValidationInput{RequestValidationInput: in, Status: resp.StatusCode, Header: resp.Header,
		Options: &openapi3filter.Options{MultiError: true, IncludeResponseStatus: true}}
	out.SetBodyBytes(got)
	if err := openapi3filter.ValidateResponse(context.Background(), out); err != nil {
		t.Errorf("POST %s: the gateway's error answer (%d) does not follow gateway/openapi.yaml: %v\n%s", path, resp.StatusCode, err, truncate(got, 600))
	}
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(got, &e) != nil || e.Error.Code == "" {
		t.Errorf("POST %s: error answer without a code: %s", path, got)
	}
	return resp.StatusCode, resp.Header, got
}

// notifySock is a unix datagram socket standing in for systemd's NOTIFY_SOCKET.
func notifySock(t *testing.T, dir string) (*net.UnixConn, string) {
	t.Helper()
	p := filepath.Join(dir, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn, p
}

// nextNotify reads datagrams until one starts with prefix (within 120s: a loaded machine) and returns it.
func nextNotify(t *testing.T, conn *net.UnixConn, p *Process, prefix string) string {
	t.Helper()
	buf := make([]byte, 4096)
	if err := conn.SetReadDeadline(time.Now().Add(120 * time.Second)); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := conn.Read(buf)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("%s: no %s from the binary; log:\n%s", p.Name, prefix, p.Tail(20))
		}
		if err != nil {
			t.Fatal(err)
		}
		if msg := string(buf[:n]); strings.HasPrefix(msg, prefix) {
			return msg
		}
	}
}

// TestSystemdNotify: each of the four daemons, started as a Type=notify unit would start it
// (NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID left unset as systemd may), says READY=1 once it
// serves, pings WATCHDOG=1 while healthy, and says STOPPING=1 on SIGTERM, then exits 0.
func TestSystemdNotify(t *testing.T) {
	dir := clustertest.BinDir(t, Binaries)
	for _, tc := range []struct {
		bin  string
		args func(work string) []string
	}{
		{"kvc-gateway", func(string) []string {
			return []string{"--http-addr", "127.0.0.1:0", "--prefill-urls", "http://127.0.0.1:9", "--decode-urls", "http://127.0.0.1:9"}
		}},
		{"kvc-controlplane", func(work string) []string {
			return []string{"--node-id", "n1", "--data-dir", filepath.Join(work, "data"), "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0",
				"--embedded-etcd-client-addr", "127.0.0.1:0", "--embedded-etcd-peer-addr", "127.0.0.1:0", "--insecure"}
		}},
		{"kvc-sidecar-prefill", func(work string) []string {
			return []string{"--worker-id", "p0", "--bridge-socket", filepath.Join(work, "b.sock"), "--insecure", "--store-capacity-bytes", "1048576"}
		}},
		{"kvc-sidecar-decode", func(work string) []string {
			return []string{"--worker-id", "d0", "--bridge-socket", filepath.Join(work, "b.sock"), "--insecure"}
		}},
	} {
		t.Run(tc.bin, func(t *testing.T) {
			work := t.TempDir()
			conn, sock := notifySock(t, work)
			p, err := spawnEnv(filepath.Join(dir, tc.bin), tc.bin, "notify", work, tc.args(work),
				[]string{"NOTIFY_SOCKET=" + sock, "WATCHDOG_USEC=2000000"})
			if err != nil {
				t.Fatal(err)
			}
			defer p.kill()
			ready := nextNotify(t, conn, p, "READY=1")
			if !strings.Contains(ready, "STATUS=") {
				t.Errorf("READY=1 without a status line: %q", ready)
			}
			for range 2 {
				nextNotify(t, conn, p, "WATCHDOG=1")
			}
			if !p.Signal(syscall.SIGTERM) {
				t.Fatalf("SIGTERM not sent: %s exited\n%s", p.Name, p.Tail(20))
			}
			nextNotify(t, conn, p, "STOPPING=1")
			select {
			case <-p.Exited():
				if p.ExitErr() != nil {
					t.Fatalf("exit after SIGTERM: %v\n%s", p.ExitErr(), p.Tail(20))
				}
			case <-time.After(60 * time.Second):
				t.Fatalf("still running 60s after SIGTERM\n%s", p.Tail(20))
			}
			if b, _ := os.ReadFile(p.LogPath); !bytes.Contains(b, []byte("systemd watchdog on")) {
				t.Errorf("no 'systemd watchdog on' in the log:\n%s", p.Tail(20))
			}
		})
	}
}
