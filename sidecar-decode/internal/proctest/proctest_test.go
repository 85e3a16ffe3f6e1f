package proctest

import (
	"os"
	"path/filepath"
	"testing"
)

func TestReadEvents(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "events.jsonl")
	if got := ReadEvents(t, path); got != nil {
		t.Fatalf("missing log: %v", got)
	}
	tests := []struct {
		name, body string
		want       int
	}{
		{"empty", "", 0},
		{"two lines", `{"event":"a"}` + "\n" + `{"event":"b"}` + "\n", 2},
		{"partial last line left for later", `{"event":"a"}` + "\n" + `{"event":`, 1},
		{"only a partial line", `{"ev`, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := os.WriteFile(path, []byte(tt.body), 0o600); err != nil {
				t.Fatal(err)
			}
			if got := ReadEvents(t, path); len(got) != tt.want {
				t.Fatalf("%d events, want %d: %+v", len(got), tt.want, got)
			}
		})
	}
}
