package rdma

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// rangeGuard allows writes only inside [lo, hi) and records the peers it was asked for.
type rangeGuard struct {
	lo, hi uint64
	mu     sync.Mutex
	peers  map[string]int
}

func (g *rangeGuard) check(peer string, addr, n uint64) error {
	g.mu.Lock()
	if g.peers == nil {
		g.peers = map[string]int{}
	}
	g.peers[peer]++
	g.mu.Unlock()
	if addr < g.lo || addr+n > g.hi {
		return fmt.Errorf("[%#x, +%d) is not inside the reserved range", addr, n)
	}
	return nil
}

func TestTCPWriteGuard(t *testing.T) {
	const size = 1 << 20
	ownerMem := mmapArena(t, size)
	fillPattern(ownerMem, 11)
	localMem := mmapArena(t, size)
	fillPattern(localMem, 12)
	ra, la := tAddr(ownerMem), tAddr(localMem)
	g := &rangeGuard{lo: ra + 64<<10, hi: ra + 512<<10}

	owner := newTCPEngine(t, Config{Conns: 2, WriteGuard: g.check})
	if err := owner.RegisterMemory(Region{Addr: ra, Len: size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	// Small slices: one request becomes several WRITE_BATCH descriptors.
	cli := newTCPEngine(t, Config{Conns: 2, SliceBytes: 16 << 10})
	if err := cli.RegisterMemory(Region{Addr: la, Len: size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	ctx := waitCtx(t)
	seg, err := cli.OpenSegment(ctx, owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	type wr struct {
		off, n uint64
		ok     bool
	}
	cases := []wr{
		{64 << 10, 100, true},           // first bytes of the allowed range
		{0, 4096, false},                // before it
		{100 << 10, 200 << 10, true},    // sliced, all inside
		{512<<10 - 8, 16, false},        // straddles its end
		{600 << 10, 64 << 10, false},    // sliced, all outside: every slice refused
		{480 << 10, 64 << 10, false},    // sliced, the last slices outside: the task fails
		{512<<10 - 4096, 4096, true},    // last bytes of the allowed range
		{64<<10 - 1, 1, false},          // the byte before it
		{300 << 10, 1000, true},         // after refused ones in the same batch
		{64<<10 - 4096, 8192, false},    // straddles its start
		{256 << 10, 100 << 10, true},    // sliced
		{size - 4096, 4096, false},      // end of the region
		{400 << 10, 3, true},            // odd length
		{900 << 10, 100 << 10, false},   // sliced, outside
		{128 << 10, 16<<10 + 1, true},   // two slices, the second one byte
		{512 << 10, 16<<10 + 1, false},  // two slices, both outside
		{200<<10 + 7, 50 << 10, true},   // unaligned
		{20 << 10, 20<<10 + 123, false}, // unaligned, outside
	}
	reqs := make([]Request, len(cases))
	for i, c := range cases {
		reqs[i] = Request{OpWrite, la + c.off, seg, ra + c.off, c.n}
	}
	want := append([]byte(nil), ownerMem...)
	res, err := TransferSync(ctx, cli, reqs, Deadline{Base: 10 * time.Second})
	if !errors.Is(err, ErrOutOfBounds) {
		t.Fatalf("batch error %v, want ErrOutOfBounds", err)
	}
	for i, c := range cases {
		st := res.Tasks[i]
		if c.ok {
			if st.State != TaskCompleted || st.BytesDone != c.n {
				t.Fatalf("write %d [%d, +%d): %+v, want completed", i, c.off, c.n, st)
			}
			copy(want[c.off:c.off+c.n], localMem[c.off:c.off+c.n])
			continue
		}
		if st.State != TaskFailed || !errors.Is(st.Err, ErrOutOfBounds) || !strings.Contains(st.Err.Error(), "write guard") ||
			!strings.Contains(st.Err.Error(), "not inside the reserved range") {
			t.Fatalf("write %d [%d, +%d): %+v, want refused by the write guard", i, c.off, c.n, st)
		}
	}
	// Allowed slices of a failed task land (the task fails as a whole); refused bytes never do.
	for i, c := range cases {
		if c.ok {
			continue
		}
		for off := uint64(0); off < c.n; off += 16 << 10 {
			n := min(16<<10, c.n-off)
			if a := ra + c.off + off; a >= g.lo && a+n <= g.hi {
				copy(want[c.off+off:c.off+off+n], localMem[c.off+off:c.off+off+n])
			}
		}
		_ = i
	}
	if !bytes.Equal(ownerMem, want) {
		for i := range ownerMem {
			if ownerMem[i] != want[i] {
				t.Fatalf("owner memory differs at offset %d", i)
			}
		}
	}
	g.mu.Lock()
	if len(g.peers) != 1 || g.peers[cli.SegmentName()] == 0 {
		t.Fatalf("guard asked for peers %v, want only %q", g.peers, cli.SegmentName())
	}
	g.mu.Unlock()

	// Removing the guard lets the region-checked write through; installing one refuses it again.
	owner.SetWriteGuard(nil)
	if _, err := TransferSync(ctx, cli, []Request{{OpWrite, la, seg, ra, 4096}}, Deadline{Base: 10 * time.Second}); err != nil {
		t.Fatalf("without a guard: %v", err)
	}
	owner.SetWriteGuard(func(string, uint64, uint64) error { return errors.New("closed for writes") })
	fillPattern(localMem[:4096], 13)
	before := append([]byte(nil), ownerMem[:4096]...)
	if _, err := TransferSync(ctx, cli, []Request{{OpWrite, la, seg, ra, 4096}}, Deadline{Base: 10 * time.Second}); !errors.Is(err, ErrOutOfBounds) || !strings.Contains(err.Error(), "closed for writes") {
		t.Fatalf("with a new guard: %v", err)
	}
	if !bytes.Equal(ownerMem[:4096], before) {
		t.Fatal("refused write landed")
	}
	// READs are not the guard's business.
	if _, err := TransferSync(ctx, cli, []Request{{OpRead, la, seg, ra, 4096}}, Deadline{Base: 10 * time.Second}); err != nil {
		t.Fatalf("read with a write guard: %v", err)
	}
}

// TestTCPWriteGuardSingleWrite drives the owner's single-WRITE frame path by hand.
func TestTCPWriteGuardSingleWrite(t *testing.T) {
	const size = 64 << 10
	mem := mmapArena(t, size)
	ra := tAddr(mem)
	g := &rangeGuard{lo: ra, hi: ra + size/2}
	owner := newTCPEngine(t, Config{Conns: 1, WriteGuard: g.check})
	if err := owner.RegisterMemory(Region{Addr: ra, Len: size, Kind: MemHost}); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", owner.SegmentName())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	if _, err := c.Write(tcpEncodeHello(tcpHello{version: tcpWireVersion, name: "raw-peer"})); err != nil {
		t.Fatal(err)
	}
	if _, n, err := tcpReadHeader(br); err != nil {
		t.Fatal(err)
	} else if _, err := tcpReadBody(br, n); err != nil {
		t.Fatal(err)
	}
	write := func(id, addr uint64, payload []byte) {
		f := binary.LittleEndian.AppendUint32(nil, uint32(1+16+len(payload)))
		f = append(f, tcpFtWrite)
		f = binary.LittleEndian.AppendUint64(f, id)
		f = binary.LittleEndian.AppendUint64(f, addr)
		if _, err := c.Write(append(f, payload...)); err != nil {
			t.Fatal(err)
		}
	}
	payload := bytes.Repeat([]byte{0xab}, 512)
	write(1, ra+size/2, payload) // refused by the guard
	write(2, ra, payload)        // allowed
	typ, n, err := tcpReadHeader(br)
	if err != nil || typ != tcpFtWriteAck {
		t.Fatalf("first answer: type %d, %v", typ, err)
	}
	body, err := tcpReadBody(br, n)
	if err != nil {
		t.Fatal(err)
	}
	if id, st := binary.LittleEndian.Uint64(body), body[8]; id != 1 || st != tcpStOutOfBounds || !strings.Contains(string(body[11:]), "write guard") {
		t.Fatalf("WRITE_ACK id %d status %d %q", id, st, body[11:])
	}
	typ, n, err = tcpReadHeader(br)
	if err != nil || typ != tcpFtWriteAckUpTo {
		t.Fatalf("second answer: type %d, %v", typ, err)
	}
	if body, err := tcpReadBody(br, n); err != nil || binary.LittleEndian.Uint64(body) != 2 {
		t.Fatalf("WRITE_ACK_UPTO %v %v", body, err)
	}
	if !bytes.Equal(mem[:512], payload) || !bytes.Equal(mem[size/2:size/2+512], make([]byte, 512)) {
		t.Fatal("owner memory: the allowed write is missing or the refused one landed")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.peers["raw-peer"] != 2 {
		t.Fatalf("guard peers %v", g.peers)
	}
}
