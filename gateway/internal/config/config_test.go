package config

import (
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(t *testing.T, c *Config)
	}{
		{name: "defaults with cp", args: []string{"--control-plane", "a:1, b:2", "--insecure"}, check: func(t *testing.T, c *Config) {
			if len(c.ControlPlanes) != 2 || c.ControlPlanes[1] != "b:2" || c.RequestTimeout != 180*time.Second || c.RouteTimeout != 2*time.Second {
				t.Fatalf("got %+v", c)
			}
		}},
		{name: "env fills", args: []string{"--control-plane", "a:1"}, env: map[string]string{"KVC_ROUTE_TIMEOUT": "500ms", "KVC_INSECURE": "true"}, check: func(t *testing.T, c *Config) {
			if c.RouteTimeout != 500*time.Millisecond {
				t.Fatalf("route timeout %v", c.RouteTimeout)
			}
		}},
		{name: "flag wins over env", args: []string{"--control-plane", "a:1", "--route-timeout", "1s", "--insecure"}, env: map[string]string{"KVC_ROUTE_TIMEOUT": "500ms"}, check: func(t *testing.T, c *Config) {
			if c.RouteTimeout != time.Second {
				t.Fatalf("route timeout %v", c.RouteTimeout)
			}
		}},
		{name: "workers with peer", args: []string{"--prefill-urls", "http://p:1|127.0.0.1:9", "--decode-urls", "http://d:1/,http://d:2", "--insecure"}, check: func(t *testing.T, c *Config) {
			if c.PrefillURLs[0].PeerAddr != "127.0.0.1:9" || c.DecodeURLs[0].URL != "http://d:1" || len(c.DecodeURLs) != 2 {
				t.Fatalf("got %+v %+v", c.PrefillURLs, c.DecodeURLs)
			}
		}},
		{name: "tokenize cache default", args: []string{"--control-plane", "a", "--insecure"}, check: func(t *testing.T, c *Config) {
			if c.TokenizeCacheBytes != 64<<20 {
				t.Fatalf("tokenize cache %d", c.TokenizeCacheBytes)
			}
		}},
		{name: "tokenize cache flag", args: []string{"--control-plane", "a", "--insecure", "--tokenize-cache-bytes", "0"}, env: map[string]string{"KVC_GATEWAY_TOKENIZE_CACHE_BYTES": "4096"}, check: func(t *testing.T, c *Config) {
			if c.TokenizeCacheBytes != 0 {
				t.Fatalf("tokenize cache %d, want the flag's 0", c.TokenizeCacheBytes)
			}
		}},
		{name: "tokenize cache env", args: []string{"--control-plane", "a", "--insecure"}, env: map[string]string{"KVC_TOKENIZE_CACHE_BYTES": "1048576", "KVC_GATEWAY_TOKENIZE_CACHE_BYTES": "4096"}, check: func(t *testing.T, c *Config) {
			if c.TokenizeCacheBytes != 1<<20 {
				t.Fatalf("tokenize cache %d, want KVC_TOKENIZE_CACHE_BYTES's", c.TokenizeCacheBytes)
			}
		}},
		{name: "tokenize cache legacy env", args: []string{"--control-plane", "a", "--insecure"}, env: map[string]string{"KVC_GATEWAY_TOKENIZE_CACHE_BYTES": "4096"}, check: func(t *testing.T, c *Config) {
			if c.TokenizeCacheBytes != 4096 {
				t.Fatalf("tokenize cache %d, want the legacy variable's 4096", c.TokenizeCacheBytes)
			}
		}},
		{name: "tokenize cache bad legacy env", args: []string{"--control-plane", "a", "--insecure"}, env: map[string]string{"KVC_GATEWAY_TOKENIZE_CACHE_BYTES": "lots"}, wantErr: "KVC_GATEWAY_TOKENIZE_CACHE_BYTES"},
		{name: "tokenize cache negative", args: []string{"--control-plane", "a", "--insecure", "--tokenize-cache-bytes", "-1"}, wantErr: "--tokenize-cache-bytes must not be negative"},
		{name: "no backend", args: nil, wantErr: "give --control-plane"},
		{name: "bad url", args: []string{"--prefill-urls", "p:1", "--decode-urls", "http://d"}, wantErr: "not an http(s) URL"},
		{name: "bad env", args: []string{"--control-plane", "a"}, env: map[string]string{"KVC_REQUEST_TIMEOUT": "forever"}, wantErr: "KVC_REQUEST_TIMEOUT"},
		{name: "route longer than request", args: []string{"--control-plane", "a", "--route-timeout", "5s", "--request-timeout", "1s"}, wantErr: "shorter than"},
		{name: "bad level", args: []string{"--control-plane", "a", "--log-level", "loud"}, wantErr: "--log-level"},
		{name: "partial tls", args: []string{"--control-plane", "a", "--tls-cert", "c.pem"}, wantErr: "--tls-key, --tls-ca missing"},
		{name: "partial tls from env", args: []string{"--control-plane", "a"}, env: map[string]string{"KVC_TLS_KEY": "k.pem"}, wantErr: "--tls-cert, --tls-ca missing"},
		{name: "https needs a key", args: []string{"--control-plane", "a", "--http-tls-cert", "c.pem"}, wantErr: "--http-tls-key missing"},
		{name: "tls from env", args: []string{"--control-plane", "a"}, env: map[string]string{"KVC_TLS_CERT": "c", "KVC_TLS_KEY": "k", "KVC_TLS_CA": "a"}, check: func(t *testing.T, c *Config) {
			if c.TLS.Cert != "c" || c.TLS.Key != "k" || c.TLS.CA != "a" {
				t.Fatalf("tls %+v", c.TLS)
			}
		}},
		{name: "cp without tls or --insecure", args: []string{"--control-plane", "a"}, wantErr: "or --insecure for plaintext"},
		{name: "peer addr without tls or --insecure", args: []string{"--prefill-urls", "http://p:1|127.0.0.1:9", "--decode-urls", "http://d:1"}, wantErr: "or --insecure"},
		{name: "no grpc at all needs no --insecure", args: []string{"--prefill-urls", "http://p:1", "--decode-urls", "http://d:1"}, check: func(t *testing.T, c *Config) {
			if c.TLS.Insecure || c.TLS.Enabled() {
				t.Fatalf("tls %+v", c.TLS)
			}
		}},
		{name: "tls and --insecure", args: []string{"--control-plane", "a", "--insecure", "--tls-cert", "c", "--tls-key", "k", "--tls-ca", "a"}, wantErr: "--insecure contradicts"},
		{name: "admission defaults", args: []string{"--control-plane", "a", "--insecure"}, check: func(t *testing.T, c *Config) {
			if c.MaxInflightRequests != 4096 || c.MaxInflightBodyBytes != 64<<20 || c.AdmissionRetryAfter != time.Second {
				t.Fatalf("admission %d %d %v", c.MaxInflightRequests, c.MaxInflightBodyBytes, c.AdmissionRetryAfter)
			}
		}},
		{name: "admission from env", args: []string{"--control-plane", "a", "--insecure"}, env: map[string]string{"KVC_MAX_INFLIGHT_REQUESTS": "8", "KVC_MAX_INFLIGHT_BODY_BYTES": "100000000", "KVC_ADMISSION_RETRY_AFTER": "3s"}, check: func(t *testing.T, c *Config) {
			if c.MaxInflightRequests != 8 || c.MaxInflightBodyBytes != 100000000 || c.AdmissionRetryAfter != 3*time.Second {
				t.Fatalf("admission %d %d %v", c.MaxInflightRequests, c.MaxInflightBodyBytes, c.AdmissionRetryAfter)
			}
		}},
		{name: "zero inflight", args: []string{"--control-plane", "a", "--insecure", "--max-inflight-requests", "0"}, wantErr: "--max-inflight-requests"},
		{name: "body budget below one body", args: []string{"--control-plane", "a", "--insecure", "--max-inflight-body-bytes", "1000"}, wantErr: "--max-inflight-body-bytes (1000) must be at least --max-body-bytes"},
		{name: "tokenize budget below one request", args: []string{"--control-plane", "a", "--insecure", "--max-inflight-tokenize-bytes", "1000"}, wantErr: "--max-inflight-tokenize-bytes (1000) must be at least --max-tokenize-bytes"},
		{name: "token budget below one request", args: []string{"--control-plane", "a", "--insecure", "--max-inflight-tokens", "10"}, wantErr: "--max-inflight-tokens (10) must be at least --max-request-tokens"},
		{name: "negative per-client bound", args: []string{"--control-plane", "a", "--insecure", "--max-inflight-per-client", "-1"}, wantErr: "--max-inflight-per-client must not be negative"},
		{name: "negative abort leak", args: []string{"--control-plane", "a", "--insecure", "--client-aborted-tokens-per-second", "-1"}, wantErr: "--client-aborted-tokens-per-second must not be negative"},
		{name: "negative retry-after", args: []string{"--control-plane", "a", "--insecure", "--admission-retry-after", "-1s"}, wantErr: "--admission-retry-after"},
		{name: "parsers", args: []string{"--control-plane", "a", "--insecure", "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3"}, check: func(t *testing.T, c *Config) {
			if c.ToolCallParser != "qwen25" || c.ReasoningParser != "qwen3" {
				t.Fatalf("parsers %q %q", c.ToolCallParser, c.ReasoningParser)
			}
		}},
		{name: "default chat template kwargs", args: []string{"--control-plane", "a", "--insecure", "--default-chat-template-kwargs", `{"enable_thinking": false}`, "--tokenizer", "/models/qwen3"}, check: func(t *testing.T, c *Config) {
			if c.DefaultKwargs == nil || c.DefaultKwargs.Values["enable_thinking"] != false {
				t.Fatalf("defaults %+v", c.DefaultKwargs)
			}
		}},
		{name: "default chat template kwargs without tokenizer", args: []string{"--control-plane", "a", "--insecure", "--default-chat-template-kwargs", `{"enable_thinking": false}`}, wantErr: "needs --tokenizer"},
		{name: "bad default chat template kwargs", args: []string{"--control-plane", "a", "--insecure", "--default-chat-template-kwargs", `[1]`}, wantErr: "--default-chat-template-kwargs must be a JSON object"},
		{name: "unknown tool-call parser", args: []string{"--control-plane", "a", "--insecure", "--tool-call-parser", "mistral"}, wantErr: "--tool-call-parser \"mistral\""},
		{name: "unknown reasoning parser", args: []string{"--control-plane", "a", "--insecure", "--reasoning-parser", "kimi"}, wantErr: "--reasoning-parser \"kimi\""},
		{name: "generation config", args: []string{"--control-plane", "a", "--insecure", "--generation-config", filepath.Join("..", "api", "testdata", "generation_config_qwen3.json")}, check: func(t *testing.T, c *Config) {
			if c.GenerationDefaults == nil || strings.Join(c.GenerationDefaults.Keys, ",") != "temperature,top_k,top_p" {
				t.Fatalf("generation defaults %+v", c.GenerationDefaults)
			}
		}},
		{name: "missing generation config", args: []string{"--control-plane", "a", "--insecure", "--generation-config", "/nonexistent/generation_config.json"}, wantErr: "--generation-config: open /nonexistent"},
		{name: "unknown flag", args: []string{"--nope"}, wantErr: "flag provided but not defined"},
		{name: "stray arg", args: []string{"--control-plane", "a", "x"}, wantErr: "unexpected arguments"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			getenv := func(k string) string { return tt.env[k] }
			c, err := Parse(tt.args, getenv, io.Discard)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, c)
		})
	}
}
