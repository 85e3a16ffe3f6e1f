package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/report"
)

// Progress draws a progress bar on a terminal, or prints a plain line every 10% (or 15 s)
// otherwise.
type Progress struct {
	w     io.Writer
	tty   bool
	label string
	start time.Time

	mu       sync.Mutex
	failed   int
	lastPct  int
	lastLine time.Time
	lastDraw time.Time
}

// IsTerminal reports whether f is a character device (a terminal).
func IsTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// NewProgress returns a progress reporter for one arm.
func NewProgress(w io.Writer, tty bool, label string) *Progress {
	return &Progress{w: w, tty: tty, label: label, start: time.Now(), lastPct: -1, lastLine: time.Now()}
}

// Update is an Options.Progress callback.
func (p *Progress) Update(done, total int, last *report.Record) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if last != nil && !last.OK {
		p.failed++
	}
	el := time.Since(p.start).Round(time.Second)
	if p.tty {
		if done != total && time.Since(p.lastDraw) < 100*time.Millisecond {
			return
		}
		p.lastDraw = time.Now()
		const width = 30
		n := width * done / max(total, 1)
		fmt.Fprintf(p.w, "\r%-4s [%s%s] %d/%d  failed %d  %s ", p.label, strings.Repeat("#", n), strings.Repeat(".", width-n), done, total, p.failed, el)
		if done == total {
			fmt.Fprintln(p.w)
		}
		return
	}
	pc := 100 * done / max(total, 1)
	if pc/10 != p.lastPct/10 || time.Since(p.lastLine) > 15*time.Second || done == total {
		p.lastPct, p.lastLine = pc, time.Now()
		fmt.Fprintf(p.w, "%s: %d/%d requests (%d%%), %d failed, %s elapsed\n", p.label, done, total, pc, p.failed, el)
	}
}
