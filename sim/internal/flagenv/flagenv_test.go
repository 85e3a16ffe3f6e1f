package flagenv

import (
	"flag"
	"io"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    string
		wantN   int
		wantErr bool
	}{
		{"default", nil, nil, "def", 1, false},
		{"env", nil, map[string]string{"KVC_BRIDGE_SOCKET": "/e", "KVC_PAGE_SIZE": "32"}, "/e", 32, false},
		{"flag wins", []string{"--bridge-socket", "/f"}, map[string]string{"KVC_BRIDGE_SOCKET": "/e"}, "/f", 1, false},
		{"bad env", nil, map[string]string{"KVC_PAGE_SIZE": "many"}, "", 0, true},
		{"bad flag", []string{"--page-size", "x"}, nil, "", 0, true},
		{"stray arg", []string{"extra"}, nil, "", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			s := fs.String("bridge-socket", "def", "")
			n := fs.Int("page-size", 1, "")
			err := Parse(fs, tt.args, func(k string) string { return tt.env[k] })
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if err == nil && (*s != tt.want || *n != tt.wantN) {
				t.Fatalf("got %q %d, want %q %d", *s, *n, tt.want, tt.wantN)
			}
		})
	}
	if EnvName("model-bytes-per-token") != "KVC_MODEL_BYTES_PER_TOKEN" {
		t.Fatal(EnvName("model-bytes-per-token"))
	}
}
