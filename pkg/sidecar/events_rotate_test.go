package sidecar

import (
	"bufio"
	"encoding/json"
	"flag"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
)

// TestEventLogRotates: past --event-log-max-mb the event log is rotated into backups, at most
// --event-log-max-backups of them are kept, and every file holds whole JSON lines.
func TestEventLogRotates(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "sidecar-decode-0.events.jsonl")
	l, err := OpenEventLog(path, "d0", Rotation{MaxMB: 1, MaxBackups: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	reason := strings.Repeat("x", 1000)
	const n = 5000 // ~5.1 MB: five rotations at 1 MB
	for i := range n {
		l.Emit(Event{Event: EvTransferFailed, Session: "s", Attempt: i + 1, Reason: reason})
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	backups := func() []string {
		m, err := filepath.Glob(filepath.Join(dir, "sidecar-decode-0.events-*.jsonl"))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// The oldest backups are removed by the rotating writer's own goroutine just after a
	// rotation: wait for that, bounded.
	deadline := time.Now().Add(10 * time.Second)
	for len(backups()) > 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	bs := backups()
	if len(bs) != 2 {
		t.Fatalf("%d backups %v, want 2 (rotated, bounded by MaxBackups)", len(bs), bs)
	}
	lines := 0
	last := 0
	for _, f := range append(bs, path) {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > 1<<20 {
			t.Errorf("%s: %d bytes, over the 1 MB bound", f, st.Size())
		}
		fh, err := os.Open(f)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(fh)
		sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
		for sc.Scan() {
			var e Event
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				t.Fatalf("%s: line %q: %v", f, sc.Text()[:min(80, len(sc.Text()))], err)
			}
			lines++
			last = max(last, e.Attempt)
		}
		_ = fh.Close()
	}
	// The current file and two backups hold the last ~3 MB of events, the newest among them.
	if last != n || lines < 2000 || lines >= n {
		t.Fatalf("kept %d lines up to attempt %d; want the newest (%d) and between 2000 and %d lines", lines, last, n, n)
	}
}

func TestEventLogRotationFlags(t *testing.T) {
	base := []string{"--worker-id", "w", "--bridge-socket", "/tmp/x.sock", "--insecure"}
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		want    Rotation
	}{
		{"defaults", base, nil, "", Rotation{MaxMB: 100, MaxBackups: 5}},
		{"flags", append(base, "--event-log-max-mb", "8", "--event-log-max-backups", "3"), nil, "", Rotation{MaxMB: 8, MaxBackups: 3}},
		{"env", base, map[string]string{"KVC_EVENT_LOG_MAX_MB": "16", "KVC_EVENT_LOG_MAX_BACKUPS": "10"}, "", Rotation{MaxMB: 16, MaxBackups: 10}},
		{"no backups", append(base, "--event-log-max-backups", "0"), nil, "--event-log-max-backups", Rotation{}},
		{"zero size", append(base, "--event-log-max-mb", "0"), nil, "--event-log-max-mb", Rotation{}},
		{"unparsable", base, map[string]string{"KVC_EVENT_LOG_MAX_MB": "big"}, "KVC_EVENT_LOG_MAX_MB", Rotation{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			var c Common
			c.Register(fs)
			err := flagenv.Parse(fs, tc.args, func(k string) string { return tc.env[k] })
			if err == nil {
				err = c.Check()
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v; want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil || c.EventLogRotation != tc.want {
				t.Fatalf("err %v, rotation %+v, want %+v", err, c.EventLogRotation, tc.want)
			}
		})
	}
	if _, err := OpenEventLog(filepath.Join(t.TempDir(), "missing", "e.jsonl"), "w", Rotation{MaxMB: 1, MaxBackups: 1}, nil); err == nil {
		t.Fatal("an event log path in a missing folder accepted")
	}
}
