package obs

import (
	"encoding/json"
	"fmt"
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
