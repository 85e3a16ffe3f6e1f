package rdma

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"reflect"
	"syscall"
	"testing"
)

func TestTCPHandshakeRoundTrip(t *testing.T) {
	hs := []tcpHello{
		{version: 1, conn: 3, name: "10.0.0.1:7000"},
		{version: 1, tcpShape: tcpShape{true, 16, 16 * 1024, 48}},
	}
	for _, h := range hs {
		f := tcpEncodeHello(h)
		got, err := tcpDecodeHello(f[5:])
		if err != nil || !reflect.DeepEqual(got, h) {
			t.Fatalf("hello %+v -> %+v, %v", h, got, err)
		}
	}
	a := tcpHelloAck{version: 1, status: tcpStLayout, msg: "no", tcpShape: tcpShape{true, 16, 64, 2},
		regions: []Region{{Addr: 4096, Len: 100, Kind: MemShared, Location: "/dev/shm/x"}, {Addr: 1 << 40, Len: 1, Kind: MemHost}}}
	f := tcpEncodeHelloAck(a)
	got, err := tcpDecodeHelloAck(f[5:])
	if err != nil || !reflect.DeepEqual(got, a) {
		t.Fatalf("ack %+v -> %+v, %v", a, got, err)
	}
	bad := [][]byte{
		nil,
		f[5:20],                     // truncated
		append(f[5:], 0),            // trailing byte
		append([]byte{0}, f[6:]...), // bad magic
	}
	for i, b := range bad {
		if _, err := tcpDecodeHelloAck(b); err == nil {
			t.Errorf("bad ack %d decoded", i)
		}
	}
}

// FuzzTCPHandshake: the handshake decoders never panic, and what they accept re-encodes to the
// same value.
func FuzzTCPHandshake(f *testing.F) {
	f.Add(tcpEncodeHello(tcpHello{version: 1, conn: 2, name: "h:1", tcpShape: tcpShape{true, 16, 32, 4}})[5:])
	f.Add(tcpEncodeHelloAck(tcpHelloAck{version: 1, regions: []Region{{Addr: 1, Len: 2, Kind: MemHost, Location: "cpu"}}})[5:])
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, 64))
	f.Fuzz(func(t *testing.T, b []byte) {
		if h, err := tcpDecodeHello(b); err == nil {
			again, err := tcpDecodeHello(tcpEncodeHello(h)[5:])
			if err != nil || !reflect.DeepEqual(again, h) {
				t.Fatalf("hello round trip: %+v -> %+v, %v", h, again, err)
			}
		}
		if a, err := tcpDecodeHelloAck(b); err == nil {
			for _, r := range a.regions {
				if r.Len == 0 || r.Addr+r.Len < r.Addr {
					t.Fatalf("invalid region accepted: %+v", r)
				}
			}
			again, err := tcpDecodeHelloAck(tcpEncodeHelloAck(a)[5:])
			if err != nil || !reflect.DeepEqual(again, a) {
				t.Fatalf("ack round trip: %+v -> %+v, %v", a, again, err)
			}
		}
	})
}

func writeFrame(id, addr uint64, payload []byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, uint32(1+16+len(payload)))
	b = append(b, tcpFtWrite)
	b = binary.LittleEndian.AppendUint64(b, id)
	b = binary.LittleEndian.AppendUint64(b, addr)
	return append(b, payload...)
}

func writeBatchFrame(first uint64, addrs []uint64, payloads [][]byte) []byte {
	var body []byte
	body = binary.LittleEndian.AppendUint64(body, first)
	body = binary.LittleEndian.AppendUint32(body, uint32(len(addrs)))
	for i, a := range addrs {
		body = binary.LittleEndian.AppendUint64(body, a)
		body = binary.LittleEndian.AppendUint32(body, uint32(len(payloads[i])))
	}
	for _, p := range payloads {
		body = append(body, p...)
	}
	b := binary.LittleEndian.AppendUint32(nil, uint32(1+len(body)))
	b = append(b, tcpFtWriteBatch)
	return append(b, body...)
}

func readFrame(id, addr uint64, n uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 1+20)
	b = append(b, tcpFtRead)
	b = binary.LittleEndian.AppendUint64(b, id)
	b = binary.LittleEndian.AppendUint64(b, addr)
	return binary.LittleEndian.AppendUint32(b, n)
}

// FuzzTCPServe feeds arbitrary bytes to the owner's request decoder: it never panics, and no
// byte outside the registered region ever changes.
func FuzzTCPServe(f *testing.F) {
	const guard, size = 4096, 4096
	mem := mmapArena(f, guard+size+guard)
	region := mem[guard : guard+size]
	ra := tAddr(region)
	e := &tcpEngine{}
	if err := e.regions.add(Region{Addr: ra, Len: size, Kind: MemHost}); err != nil {
		f.Fatal(err)
	}
	f.Add(writeFrame(1, ra, []byte("hello")))
	f.Add(writeFrame(2, ra+size-2, []byte("over the end")))
	f.Add(writeFrame(3, ra-4, []byte("before")))
	f.Add(append(readFrame(4, ra, 16), readFrame(5, ra+size, 1)...))
	f.Add(append(writeFrame(6, ra, nil), 0xff))
	f.Add([]byte{0, 0, 0, 0, 1})
	f.Add(writeBatchFrame(7, []uint64{ra, ra + 100, ra + size - 3}, [][]byte{[]byte("abc"), []byte("de"), []byte("fghij")}))
	f.Add(writeBatchFrame(9, []uint64{ra + 10, ra - 1}, [][]byte{[]byte("ok"), []byte("no")}))
	f.Fuzz(func(t *testing.T, b []byte) {
		for i := range mem {
			mem[i] = 0xa5
		}
		var out bytes.Buffer
		_ = e.serveData(bufio.NewReader(bytes.NewReader(b)), bufio.NewWriter(&out), nil, nil)
		for i := 0; i < guard; i++ {
			if mem[i] != 0xa5 || mem[guard+size+i] != 0xa5 {
				t.Fatalf("byte outside the region changed (offset %d)", i)
			}
		}
	})
}

// FuzzTCPServeSocket is FuzzTCPServe over a real socket, so WRITE_BATCH payloads take the readv
// path (back-to-back targets joined into one iovec) that a plain reader cannot reach: no byte
// outside the registered region (two adjacent regions here) ever changes.
func FuzzTCPServeSocket(f *testing.F) {
	const guard, size = 4096, 4096
	mem := mmapArena(f, guard+2*size+guard)
	ra := tAddr(mem[guard:])
	e := &tcpEngine{}
	for h := uint64(0); h < 2; h++ {
		if err := e.regions.add(Region{Addr: ra + h*size, Len: size, Kind: MemHost}); err != nil {
			f.Fatal(err)
		}
	}
	f.Add(writeBatchFrame(7, []uint64{ra, ra + 100, ra + 2*size - 3}, [][]byte{[]byte("abc"), []byte("de"), []byte("fghij")}))
	f.Add(writeBatchFrame(8, []uint64{ra + size - 2, ra + size, ra + size + 3}, [][]byte{[]byte("ab"), []byte("cde"), []byte("f")}))
	f.Add(writeBatchFrame(9, []uint64{ra + 10, ra - 1}, [][]byte{[]byte("ok"), []byte("no")}))
	f.Add(writeBatchFrame(10, []uint64{ra + 2*size - 4, ra + 2*size}, [][]byte{[]byte("last"), []byte("x")}))
	f.Add(append(writeBatchFrame(11, []uint64{ra, ra + 5}, [][]byte{[]byte("hello"), bytes.Repeat([]byte("w"), 3000)}), writeFrame(12, ra+size, []byte("z"))...))
	f.Fuzz(func(t *testing.T, b []byte) {
		for i := range mem {
			mem[i] = 0xa5
		}
		fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
		if err != nil {
			t.Fatal(err)
		}
		conn := func(fd int) net.Conn {
			f := os.NewFile(uintptr(fd), "fuzz")
			defer f.Close()
			c, err := net.FileConn(f)
			if err != nil {
				t.Fatal(err)
			}
			return c
		}
		in, out := conn(fds[0]), conn(fds[1])
		sent := make(chan struct{})
		go func() {
			defer close(sent)
			_, _ = in.Write(b)
			in.Close()
		}()
		raw, err := out.(syscall.Conn).SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		_ = e.serveData(bufio.NewReaderSize(out, tcpServeBufSize), bufio.NewWriter(io.Discard), raw, nil)
		out.Close()
		<-sent
		for i := 0; i < guard; i++ {
			if mem[i] != 0xa5 || mem[guard+2*size+i] != 0xa5 {
				t.Fatalf("byte outside the regions changed (offset %d)", i)
			}
		}
	})
}

// FuzzTCPResponses feeds arbitrary owner answers to the dialing side's decoder with one WRITE and
// one READ in flight: no panic, and no local byte outside the READ's destination changes.
func FuzzTCPResponses(f *testing.F) {
	const guard, size = 4096, 64
	mem := mmapArena(f, guard+size+guard)
	dst := tAddr(mem) + guard
	ack := tcpAppendWriteAck(nil, 1, tcpStOK, "")
	resp := binary.LittleEndian.AppendUint32(nil, 1+9+size)
	resp = append(resp, tcpFtReadResp)
	resp = binary.LittleEndian.AppendUint64(resp, 2)
	resp = append(resp, tcpStOK)
	resp = append(resp, bytes.Repeat([]byte{7}, size)...)
	f.Add(append(ack, resp...))
	f.Add(append(tcpAppendWriteAck(nil, 1, tcpStOutOfBounds, "no"), resp[:20]...))
	f.Add([]byte{9, 0, 0, 0, tcpFtReadResp, 2, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add(append(tcpAppendAckUpTo(nil, 1), resp...))
	f.Add(tcpAppendAckUpTo(nil, 2))
	f.Fuzz(func(t *testing.T, b []byte) {
		for i := range mem {
			mem[i] = 0xa5
		}
		local := &memRegion{Region: Region{Addr: dst, Len: size}}
		bt := &batch{capacity: 2}
		tasks, _ := bt.add(2)
		c := &tcpConn{br: bufio.NewReader(bytes.NewReader(b)), space: make(chan struct{}, 1), done: make(chan struct{})}
		c.inflight = []sliceOp{
			{t: &tasks[0], b: bt, op: OpWrite, local: local, laddr: dst, raddr: 1 << 40, n: size, id: 1},
			{t: &tasks[1], b: bt, op: OpRead, local: local, laddr: dst, raddr: 1 << 40, n: size, id: 2},
		}
		tasks[0].left.Store(1)
		tasks[1].left.Store(1)
		err := c.readResponses()
		if err == nil || (err != io.EOF && err != io.ErrUnexpectedEOF && !isProtocol(err)) {
			t.Fatalf("unexpected end: %v", err)
		}
		for i := 0; i < guard; i++ {
			if mem[i] != 0xa5 || mem[guard+size+i] != 0xa5 {
				t.Fatalf("local byte outside the destination changed (offset %d)", i)
			}
		}
	})
}

func isProtocol(err error) bool { return errors.Is(err, tcpErrProtocol) }

// serveData is servePeer for a peer that announced no name (the fuzz targets feed it frames).
func (e *tcpEngine) serveData(br *bufio.Reader, bw *bufio.Writer, raw syscall.RawConn, dl readDeadliner) error {
	return e.servePeer(br, bw, raw, dl, "")
}
