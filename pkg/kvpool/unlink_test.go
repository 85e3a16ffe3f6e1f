package kvpool

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestUnlinkLeavesNoFileAndStaysMappable(t *testing.T) {
	dir := t.TempDir()
	p, err := Create(dir, Spec{PageSize: 4, ItemLen: 64, NumLayers: 2, PageCount: 8, Name: "u"})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	old := p.Path()
	if err := p.Unlink(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Fatalf("pool file still there after Unlink: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("directory holds %v", ents)
	}
	if !strings.HasPrefix(p.Path(), "/proc/") {
		t.Fatalf("path after Unlink %q", p.Path())
	}
	// Another mapping through the new path sees the same bytes (what a sidecar does).
	m, err := Map(p.Path(), p.Offset(1), int64(p.Spec().BufferStride()))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	p.Buffer(1)[5] = 0xab
	if m.Bytes()[5] != 0xab {
		t.Fatal("mapping through the /proc path does not share the pool's memory")
	}
	if err := p.Unlink(); err != nil { // twice is fine
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "x")); !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

func TestMLASpec(t *testing.T) {
	p, err := Create(t.TempDir(), Spec{PageSize: 4, ItemLen: 64, NumLayers: 3, PageCount: 8, MLA: true})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	l := p.Layout()
	if p.NumBuffers() != 3 || l.NumBuffers() != 3 || !l.MLA || l.Validate() != nil {
		t.Fatalf("MLA pool: %d buffers, layout %+v (%v)", p.NumBuffers(), l, l.Validate())
	}
	if err := FillTokens(p, 7, []int64{2, 5}, 0, 8); err != nil {
		t.Fatal(err)
	}
	if bad, err := CheckTokens(p, 7, []int64{2, 5}, 0, 8); err != nil || bad != 0 {
		t.Fatalf("check: %d bad, %v", bad, err)
	}
}
