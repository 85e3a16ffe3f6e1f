package server

import (
	"encoding/json"
	"io"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestOpenAI(t *testing.T) {
	direct := decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct())
	tests := []struct {
		name, path, body string
		stream           bool
		wantText         string
	}{
		{"chat stream", "/v1/chat/completions", `{"model":"m","stream":true,"max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`, true, "t0 t1 t2 "},
		{"chat", "/v1/chat/completions", `{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, false, "t0 t1 "},
		{"completion stream", "/v1/completions", `{"model":"m","stream":true,"max_tokens":2,"prompt":"hi"}`, true, "t0 t1 "},
		{"completion", "/v1/completions", `{"model":"m","max_tokens":3,"prompt":"hi"}`, false, "t0 t1 t2 "},
		{"generate", "/generate", `{"text":"hi","sampling_params":{"max_new_tokens":2}}`, false, "t0 t1 "},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := setup(t, direct, nil, nil, 0)
			resp := post(t, e.gw.URL, tt.path, "s9", tt.body)
			if resp.StatusCode != 200 || resp.Header.Get("X-KVC-Mode") != "DIRECT_TO_D" || resp.Header.Get("X-KVC-Decision-Id") == "" {
				t.Fatalf("status %d headers %v", resp.StatusCode, resp.Header)
			}
			var text strings.Builder
			var kvc map[string]any
			if tt.stream {
				ev := sse(t, resp.Body)
				if ev[len(ev)-1] != "[DONE]" {
					t.Fatalf("events %v", ev)
				}
				for _, p := range ev[:len(ev)-1] {
					var c struct {
						Object  string `json:"object"`
						Choices []struct {
							Text  string `json:"text"`
							Delta struct {
								Content string `json:"content"`
							} `json:"delta"`
						} `json:"choices"`
						KVC map[string]any `json:"kvc"`
					}
					if err := json.Unmarshal([]byte(p), &c); err != nil {
						t.Fatalf("chunk %q: %v", p, err)
					}
					text.WriteString(c.Choices[0].Text + c.Choices[0].Delta.Content)
					if c.KVC != nil {
						kvc = c.KVC
					}
				}
			} else {
				raw, _ := io.ReadAll(resp.Body)
				var full struct {
					Text    string `json:"text"`
					Choices []struct {
						Text    string `json:"text"`
						Message struct {
							Content string `json:"content"`
						} `json:"message"`
					} `json:"choices"`
					KVC      map[string]any `json:"kvc"`
					KVCRoute map[string]any `json:"kvc_route"`
				}
				if err := json.Unmarshal(raw, &full); err != nil {
					t.Fatalf("%q: %v", raw, err)
				}
				text.WriteString(full.Text)
				if len(full.Choices) > 0 {
					text.WriteString(full.Choices[0].Text + full.Choices[0].Message.Content)
				}
				kvc = full.KVC
				if kvc == nil {
					kvc = full.KVCRoute
				}
			}
			if text.String() != tt.wantText {
				t.Fatalf("text %q, want %q", text.String(), tt.wantText)
			}
			if kvc["mode"] != "DIRECT_TO_D" || kvc["worker"] == nil {
				t.Fatalf("kvc info %v", kvc)
			}
		})
	}
}

func TestBadRequests(t *testing.T) {
	e := setup(t, decideMode(kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT, fakecp.Direct()), nil, nil, 0)
	tests := []struct {
		name, path, sid, body string
		wantStatus            int
		wantCode              string
	}{
		{"malformed", "/v1/chat/completions", "s", `{"messages": [`, 400, "bad_request"},
		{"no session", "/v1/chat/completions", "", `{"messages":[{"role":"user","content":"x"}]}`, 400, "missing_session_id"},
		{"not json", "/generate", "s", `hello`, 400, "bad_request"},
		{"impossible length", "/generate", "s", `{"kvc":{"input_tokens":-5}}`, 400, "bad_request"},
		{"too large", "/generate", "s", `{"text":"` + strings.Repeat("x", 2<<20) + `"}`, 413, "body_too_large"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := post(t, e.gw.URL, tt.path, tt.sid, tt.body)
			code, msg := errBody(t, resp.Body)
			if resp.StatusCode != tt.wantStatus || code != tt.wantCode || msg == "" {
				t.Fatalf("got %d %s %q", resp.StatusCode, code, msg)
			}
		})
	}
	if n := len(e.cp.Queries); n != 0 {
		t.Fatalf("%d bad requests reached the control plane", n)
	}
}
