package cluster

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestPrintAddrsShowsChat (issue 23 item 6): kvc-local's banner shows a chat request (the
// OpenAI API most clients speak) before the SGLang /generate one, and its body is a valid chat
// request (the integration test sends it through a real gateway).
func TestPrintAddrsShowsChat(t *testing.T) {
	c := &Cluster{GatewayURL: "http://127.0.0.1:7", ControlPlaneAddrs: []string{"127.0.0.1:8"}}
	var b strings.Builder
	c.PrintAddrs(&b)
	out := b.String()
	chat := strings.Index(out, "curl -s http://127.0.0.1:7/v1/chat/completions -H 'X-Session-ID: demo-1' -d '"+BannerChat+"'")
	gen := strings.Index(out, "/generate")
	if chat < 0 || gen < 0 || chat > gen {
		t.Fatalf("banner lacks the chat request first:\n%s", out)
	}
	var body struct {
		Messages []struct{ Role, Content string }
	}
	if err := json.Unmarshal([]byte(BannerChat), &body); err != nil || len(body.Messages) != 1 || body.Messages[0].Role != "user" {
		t.Fatalf("BannerChat %s: %v %+v", BannerChat, err, body)
	}
}
