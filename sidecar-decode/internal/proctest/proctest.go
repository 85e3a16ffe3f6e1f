package proctest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
)

// ReadEvents parses a sidecar's event log (none yet when the file does not exist). A last line
// without its newline is being written and is left for the next read; any other line that does
// not parse fails the test.
func ReadEvents(t testing.TB, path string) []sidecar.Event {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	if i := bytes.LastIndexByte(b, '\n'); i < len(b)-1 {
		b = b[:i+1] // drop a partial last line
	}
	var out []sidecar.Event
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e sidecar.Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("event log %s line %q: %v", path, sc.Text(), err)
		}
		out = append(out, e)
	}
	return out
}
