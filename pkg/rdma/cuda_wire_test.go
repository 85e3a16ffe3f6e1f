package rdma

import (
	"bytes"
	"errors"
	"testing"
)

func testWireRegions() []cudaWireRegion {
	h := bytes.Repeat([]byte{0xab}, cudaIPCHandleSize)
	return []cudaWireRegion{
		{Region: Region{Addr: 0x7f0000000000, Len: 1 << 20, Kind: MemCUDA, Location: "cuda:1",
			CUDA: &CUDAMemory{Device: 1, IPCHandle: h, Offset: 4096}}, Ptr: 0x7f0000000000},
		{Region: Region{Addr: 0x1000, Len: 64, Kind: MemHost, Location: "cpu"}, Ptr: 0x1000},
		{Region: Region{Addr: 0x7e0000000000, Len: 3 << 20, Kind: MemShared, Location: "/proc/77/fd/9"}, Ptr: 0x7e0000000000},
	}
}

func TestCUDAWireRoundTrip(t *testing.T) {
	in := testWireRegions()
	pid, out, err := cudaDecodeRegions(cudaEncodeRegions(42, in))
	if err != nil {
		t.Fatal(err)
	}
	if pid != 42 || len(out) != 3 {
		t.Fatalf("pid %d, %d regions", pid, len(out))
	}
	// sorted by address: the host region first
	if out[0].Addr != 0x1000 || out[0].CUDA != nil || out[0].Location != "cpu" || out[0].Kind != MemHost {
		t.Fatalf("host region: %+v", out[0])
	}
	// the shared-memory region carries its file path and length, no handle
	if sh := out[1]; sh.Kind != MemShared || sh.Location != "/proc/77/fd/9" || sh.Len != 3<<20 || sh.CUDA != nil || sh.Ptr != in[2].Ptr {
		t.Fatalf("shared region: %+v", sh)
	}
	c := out[2]
	if c.Addr != in[0].Addr || c.Len != in[0].Len || c.Ptr != in[0].Ptr || c.CUDA == nil ||
		c.CUDA.Device != 1 || c.CUDA.Offset != 4096 || !bytes.Equal(c.CUDA.IPCHandle, in[0].CUDA.IPCHandle) {
		t.Fatalf("cuda region: %+v %+v", c, c.CUDA)
	}
	if p, err := cudaDecodeHello(cudaEncodeHello(7)); err != nil || p != 7 {
		t.Fatalf("hello: %d %v", p, err)
	}
}

func TestCUDAWireRejects(t *testing.T) {
	good := testWireRegions()
	mutate := func(f func(r []cudaWireRegion)) []byte {
		rs := make([]cudaWireRegion, len(good))
		for i, r := range good {
			rs[i] = r
			if r.CUDA != nil {
				c := *r.CUDA
				rs[i].CUDA = &c
			}
		}
		f(rs)
		return cudaEncodeRegions(1, rs)
	}
	enc := cudaEncodeRegions(1, good)
	tests := []struct {
		name string
		msg  []byte
	}{
		{"empty", nil},
		{"bad magic", append([]byte("XXXXXXXX"), enc[8:]...)},
		{"truncated", enc[:len(enc)-3]},
		{"trailing", append(append([]byte(nil), enc...), 0)},
		{"zero length", mutate(func(r []cudaWireRegion) { r[1].Len = 0 })},
		{"wraps", mutate(func(r []cudaWireRegion) { r[1].Addr = ^uint64(0) - 8 })},
		{"bad kind", mutate(func(r []cudaWireRegion) { r[1].Kind = 9 })},
		{"short handle", mutate(func(r []cudaWireRegion) { r[0].CUDA.IPCHandle = r[0].CUDA.IPCHandle[:10] })},
		{"negative device", mutate(func(r []cudaWireRegion) { r[0].CUDA.Device = -3 })},
		{"overlap", mutate(func(r []cudaWireRegion) { r[1].Addr = r[0].Addr + 100 })},
		{"device without handle", mutate(func(r []cudaWireRegion) { r[0].CUDA = nil; r[0].Ptr = 0 })},
		{"shared without path", mutate(func(r []cudaWireRegion) { r[2].Location = "" })},
		{"shared relative path", mutate(func(r []cudaWireRegion) { r[2].Location = "dev/shm/x" })},
		{"shared with handle", mutate(func(r []cudaWireRegion) { r[2].CUDA = &CUDAMemory{Device: 0, IPCHandle: r[0].CUDA.IPCHandle} })},
		{"too many", append(append([]byte(cudaWireMagic), 0, 0, 0, 1), 0xff, 0xff, 0xff, 0xff)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, _, err := cudaDecodeRegions(tt.msg); !errors.Is(err, errCUDAWire) {
				t.Fatalf("got %v, want errCUDAWire", err)
			}
		})
	}
	for _, h := range [][]byte{nil, []byte("KVCCUDA1"), []byte("KVCCUDA2\x00\x00\x00\x01")} {
		if _, err := cudaDecodeHello(h); !errors.Is(err, errCUDAWire) {
			t.Fatalf("hello %q: %v", h, err)
		}
	}
}

func TestCUDAFrames(t *testing.T) {
	var buf bytes.Buffer
	if err := cudaWriteFrame(&buf, []byte("abc")); err != nil {
		t.Fatal(err)
	}
	if b, err := cudaReadFrame(&buf); err != nil || string(b) != "abc" {
		t.Fatalf("%q %v", b, err)
	}
	huge := []byte{0xff, 0xff, 0xff, 0xff}
	if _, err := cudaReadFrame(bytes.NewReader(huge)); !errors.Is(err, errCUDAWire) {
		t.Fatalf("oversized frame: %v", err)
	}
}

func FuzzCUDADecodeRegions(f *testing.F) {
	f.Add(cudaEncodeRegions(1, testWireRegions()))
	f.Add(cudaEncodeRegions(0, nil))
	f.Add([]byte(cudaWireMagic))
	f.Fuzz(func(t *testing.T, b []byte) {
		pid, regs, err := cudaDecodeRegions(b)
		if err != nil {
			return
		}
		for i, r := range regs {
			if r.Len == 0 || r.Addr+r.Len < r.Addr {
				t.Fatalf("accepted bad range %+v", r)
			}
			if i > 0 && r.Addr < regs[i-1].Addr+regs[i-1].Len {
				t.Fatal("accepted overlap")
			}
		}
		// what decodes re-encodes to something that decodes the same
		pid2, regs2, err := cudaDecodeRegions(cudaEncodeRegions(pid, regs))
		if err != nil || pid2 != pid || len(regs2) != len(regs) {
			t.Fatalf("re-decode: %v", err)
		}
	})
}
