package faults

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
)

// The control planes' "session re-homed" lines become the re-homes of a window: in the window,
// with unix_ms, from any control plane's log; other lines and other messages are not.
func TestRehomesFromControlPlaneLogs(t *testing.T) {
	dir := t.TempDir()
	t0 := time.UnixMilli(1_700_000_000_000)
	logs := map[string]string{
		"cp-0": `{"level":"info","session":"s1","from":"decode-1","decode":"decode-0","unix_ms":1700000001000,"message":"session re-homed"}
{"level":"info","session":"s2","from":"decode-1","decode":"decode-2","unix_ms":1700000900000,"message":"session re-homed"}
not json session re-homed
{"level":"warn","session":"s3","message":"re-home failed: the session's next turn reseeds"}
`,
		"cp-1": `{"level":"info","session":"s4","from":"decode-1","decode":"decode-2","unix_ms":1700000002000,"message":"session re-homed"}
{"level":"info","session":"s5","from":"decode-1","decode":"decode-2","message":"session re-homed"}
`,
	}
	h := &Harness{}
	for name, body := range logs {
		if err := os.WriteFile(filepath.Join(dir, name+".log"), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		h.CPs = append(h.CPs, launch.NewRestartable(launch.Spec{Name: name, Dir: dir}))
	}
	got := map[string]rehome{}
	for _, r := range h.rehomes(t0, t0.Add(time.Minute)) {
		got[r.session] = r
	}
	if len(got) != 2 || got["s1"].to != "decode-0" || got["s1"].from != "decode-1" || !got["s1"].at.Equal(t0.Add(time.Second)) ||
		got["s4"].to != "decode-2" {
		t.Fatalf("re-homes %+v, want s1 → decode-0 at +1 s and s4 → decode-2", got)
	}
}
