package launch

import (
	"os"
	"path/filepath"
	"testing"
)

func TestBinaries(t *testing.T) {
	mod := t.TempDir() // a module directory without cmd/
	binDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(binDir, "kvc-there"), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		dir      string
		need     map[string]string
		optional []string
		want     map[string]string // name → path ("" for any)
		wantErr  bool
	}{
		{"found in the binary directory", binDir, map[string]string{"kvc-there": mod}, nil,
			map[string]string{"kvc-there": filepath.Join(binDir, "kvc-there")}, false},
		{"no cmd to build", "", map[string]string{"kvc-nothing": mod}, nil, nil, true},
		{"optional and no cmd: left out", binDir, map[string]string{"kvc-nothing": mod, "kvc-there": mod}, []string{"kvc-nothing"},
			map[string]string{"kvc-there": filepath.Join(binDir, "kvc-there")}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bins, cleanup, err := Binaries(tt.dir, tt.need, tt.optional...)
			defer cleanup()
			if (err != nil) != tt.wantErr {
				t.Fatalf("err %v, want error %v", err, tt.wantErr)
			}
			if tt.wantErr {
				return
			}
			if len(bins) != len(tt.want) {
				t.Fatalf("binaries %v, want %v", bins, tt.want)
			}
			for k, v := range tt.want {
				if bins[k] != v {
					t.Fatalf("binaries %v, want %v", bins, tt.want)
				}
			}
		})
	}
}
