package flagenv

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    string
		wantN   int
		wantD   time.Duration
		wantErr []string // substrings of the error; nil: no error
	}{
		{name: "default", want: "def", wantN: 1, wantD: time.Second},
		{name: "env", env: map[string]string{"KVC_BRIDGE_SOCKET": "/e", "KVC_PAGE_SIZE": "32", "KVC_IDLE": "3s"}, want: "/e", wantN: 32, wantD: 3 * time.Second},
		{name: "flag wins", args: []string{"--bridge-socket", "/f"}, env: map[string]string{"KVC_BRIDGE_SOCKET": "/e"}, want: "/f", wantN: 1, wantD: time.Second},
		{name: "empty env is unset", env: map[string]string{"KVC_BRIDGE_SOCKET": ""}, want: "def", wantN: 1, wantD: time.Second},
		{name: "bad env names variable and flag", env: map[string]string{"KVC_PAGE_SIZE": "many"}, wantErr: []string{`KVC_PAGE_SIZE="many"`, "--page-size"}},
		{name: "every bad env reported", env: map[string]string{"KVC_PAGE_SIZE": "many", "KVC_IDLE": "forever"}, wantErr: []string{"KVC_PAGE_SIZE", "KVC_IDLE"}},
		{name: "bad flag", args: []string{"--page-size", "x"}, wantErr: []string{"page-size"}},
		{name: "stray arg", args: []string{"extra"}, wantErr: []string{"unexpected arguments"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			s := fs.String("bridge-socket", "def", "")
			n := fs.Int("page-size", 1, "")
			d := fs.Duration("idle", time.Second, "")
			err := Parse(fs, tt.args, func(k string) string { return tt.env[k] })
			if tt.wantErr != nil {
				if err == nil {
					t.Fatal("no error")
				}
				for _, w := range tt.wantErr {
					if !strings.Contains(err.Error(), w) {
						t.Fatalf("error %q does not name %q", err, w)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if *s != tt.want || *n != tt.wantN || *d != tt.wantD {
				t.Fatalf("got %q %d %s, want %q %d %s", *s, *n, *d, tt.want, tt.wantN, tt.wantD)
			}
		})
	}
}

func TestEnvName(t *testing.T) {
	for in, want := range map[string]string{
		"model-bytes-per-token": "KVC_MODEL_BYTES_PER_TOKEN",
		"worker-id":             "KVC_WORKER_ID",
		"insecure":              "KVC_INSECURE",
	} {
		if got := EnvName(in); got != want {
			t.Errorf("EnvName(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestApplyNilGetenv(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	s := fs.String("a", "def", "")
	if err := Apply(fs, nil); err != nil || *s != "def" {
		t.Fatalf("%v %q", err, *s)
	}
}
