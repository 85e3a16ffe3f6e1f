package obs

import (
	"encoding/json"
	"net"
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

func TestSdNotify(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	if sent, err := SdNotify("READY=1"); sent || err != nil {
		t.Fatalf("without socket: sent=%v err=%v", sent, err)
	}
	p := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", p)
	if sent, err := SdNotify("READY=1"); !sent || err != nil {
		t.Fatalf("sent=%v err=%v", sent, err)
	}
	buf := make([]byte, 64)
	n, err := conn.Read(buf)
	if err != nil || string(buf[:n]) != "READY=1" {
		t.Fatalf("read %q %v", buf[:n], err)
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
