package obs

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteReadyFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "ready.json")
	if err := WriteReadyFile(p, map[string]string{"grpc_addr": "127.0.0.1:1234"}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]string
	if err := json.Unmarshal(b, &got); err != nil || got["grpc_addr"] != "127.0.0.1:1234" {
		t.Fatalf("got %s (%v)", b, err)
	}
	if err := WriteReadyFile(filepath.Join(t.TempDir(), "missing", "r.json"), 1); err == nil {
		t.Fatal("want error for missing directory")
	}
}

func TestNewLoggerRejectsBadInput(t *testing.T) {
	tests := []struct {
		level, format string
		ok            bool
	}{
		{"info", "json", true}, {"debug", "console", true}, {"", "json", false}, {"loud", "json", false}, {"info", "xml", false},
	}
	for _, tt := range tests {
		_, err := NewLogger(nil, tt.level, tt.format, "x")
		if (err == nil) != tt.ok {
			t.Errorf("NewLogger(%q,%q) err=%v", tt.level, tt.format, err)
		}
	}
}
