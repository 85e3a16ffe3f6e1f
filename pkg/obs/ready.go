package obs

import (
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
)

// WriteReadyFile atomically writes v as JSON to path (write to a temp file, then rename), so a
// supervisor (kvc-local, a test) polling the path sees either nothing or the whole document.
// Binaries write it once they serve, with the addresses they actually bound (port 0 resolved).
func WriteReadyFile(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("ready file: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".ready-*")
	if err != nil {
		return fmt.Errorf("ready file: %w", err)
	}
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("ready file: %w", err)
	}
	if err := tmp.Close(); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("ready file: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		_ = os.Remove(tmp.Name())
		return fmt.Errorf("ready file: %w", err)
	}
	return nil
}

// SdNotify sends state (e.g. "READY=1", "STOPPING=1") to systemd when the process runs under a
// Type=notify unit (NOTIFY_SOCKET set); otherwise it does nothing. It reports whether a message
// was sent.
func SdNotify(state string) (bool, error) {
	sock := os.Getenv("NOTIFY_SOCKET")
	if sock == "" {
		return false, nil
	}
	if sock[0] == '@' {
		sock = "\x00" + sock[1:]
	}
	conn, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		return false, fmt.Errorf("sd_notify: %w", err)
	}
	defer conn.Close()
	if _, err := conn.Write([]byte(state)); err != nil {
		return false, fmt.Errorf("sd_notify: %w", err)
	}
	return true, nil
}
