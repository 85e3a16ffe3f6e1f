package rdma

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sort"
)

// The cuda backend's control protocol. An opener connects to the owner's control socket and
// sends a hello frame; the owner answers with a snapshot of its registered regions (with their
// CUDA IPC handles) and sends a fresh snapshot whenever its registrations change. Frames are a
// big-endian uint32 length followed by the payload. The copies themselves never touch the
// socket: the opener imports the owner's device memory and copies one-sided.

const (
	cudaWireMagic     = "KVCCUDA1"
	cudaMaxFrame      = 8 << 20
	cudaMaxRegions    = 1 << 16
	cudaMaxLocation   = 1024
	cudaHelloLen      = len(cudaWireMagic) + 4
	cudaIPCHandleSize = 64
)

var errCUDAWire = errors.New("rdma/cuda: malformed control message")

// cudaWireRegion is a region as the owner advertises it: the region, plus Ptr, the address of its
// first byte in the owner process (usable directly only by an opener in the same process).
type cudaWireRegion struct {
	Region
	Ptr uint64
}

func cudaEncodeHello(pid uint32) []byte {
	b := make([]byte, 0, cudaHelloLen)
	b = append(b, cudaWireMagic...)
	return binary.BigEndian.AppendUint32(b, pid)
}

func cudaDecodeHello(b []byte) (uint32, error) {
	if len(b) != cudaHelloLen || string(b[:len(cudaWireMagic)]) != cudaWireMagic {
		return 0, fmt.Errorf("%w: bad hello", errCUDAWire)
	}
	return binary.BigEndian.Uint32(b[len(cudaWireMagic):]), nil
}

// cudaEncodeRegions encodes a region snapshot of the process pid.
func cudaEncodeRegions(pid uint32, regs []cudaWireRegion) []byte {
	b := make([]byte, 0, 16+len(regs)*128)
	b = append(b, cudaWireMagic...)
	b = binary.BigEndian.AppendUint32(b, pid)
	b = binary.BigEndian.AppendUint32(b, uint32(len(regs)))
	for _, r := range regs {
		b = binary.BigEndian.AppendUint64(b, r.Addr)
		b = binary.BigEndian.AppendUint64(b, r.Len)
		b = append(b, byte(r.Kind))
		b = binary.BigEndian.AppendUint64(b, r.Ptr)
		dev, off := int32(-1), uint64(0)
		var h []byte
		if r.CUDA != nil {
			dev, off, h = int32(r.CUDA.Device), r.CUDA.Offset, r.CUDA.IPCHandle
		}
		b = binary.BigEndian.AppendUint32(b, uint32(dev))
		b = binary.BigEndian.AppendUint64(b, off)
		b = append(b, byte(len(h)))
		b = append(b, h...)
		b = binary.BigEndian.AppendUint16(b, uint16(len(r.Location)))
		b = append(b, r.Location...)
	}
	return b
}

// cudaWireReader consumes a byte slice and remembers the first error.
type cudaWireReader struct {
	b   []byte
	err error
}

func (r *cudaWireReader) take(n int) []byte {
	if r.err != nil {
		return nil
	}
	if n < 0 || len(r.b) < n {
		r.err = fmt.Errorf("%w: truncated", errCUDAWire)
		return nil
	}
	out := r.b[:n]
	r.b = r.b[n:]
	return out
}

func (r *cudaWireReader) u8() uint8 {
	if b := r.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (r *cudaWireReader) u16() uint16 {
	if b := r.take(2); b != nil {
		return binary.BigEndian.Uint16(b)
	}
	return 0
}

func (r *cudaWireReader) u32() uint32 {
	if b := r.take(4); b != nil {
		return binary.BigEndian.Uint32(b)
	}
	return 0
}

func (r *cudaWireReader) u64() uint64 {
	if b := r.take(8); b != nil {
		return binary.BigEndian.Uint64(b)
	}
	return 0
}

// cudaDecodeRegions decodes and validates a region snapshot: every region non-empty, without
// address overflow, of a known kind, with a well-formed IPC handle (shared memory: an absolute
// file path as Location and no handle), and no two overlapping.
// The result is sorted by address.
func cudaDecodeRegions(b []byte) (uint32, []cudaWireRegion, error) {
	r := &cudaWireReader{b: b}
	if string(r.take(len(cudaWireMagic))) != cudaWireMagic {
		return 0, nil, fmt.Errorf("%w: bad magic", errCUDAWire)
	}
	pid := r.u32()
	n := r.u32()
	if r.err != nil {
		return 0, nil, r.err
	}
	if n > cudaMaxRegions {
		return 0, nil, fmt.Errorf("%w: %d regions", errCUDAWire, n)
	}
	regs := make([]cudaWireRegion, 0, min(int(n), 1024))
	for i := uint32(0); i < n; i++ {
		var w cudaWireRegion
		w.Addr = r.u64()
		w.Len = r.u64()
		w.Kind = MemKind(r.u8())
		w.Ptr = r.u64()
		dev := int32(r.u32())
		off := r.u64()
		h := r.take(int(r.u8()))
		loc := r.take(int(r.u16()))
		if r.err != nil {
			return 0, nil, r.err
		}
		if w.Len == 0 || w.Addr+w.Len < w.Addr || w.Ptr+w.Len < w.Ptr {
			return 0, nil, fmt.Errorf("%w: region %d: bad range", errCUDAWire, i)
		}
		if w.Kind < MemHost || w.Kind > MemCUDA {
			return 0, nil, fmt.Errorf("%w: region %d: bad kind %d", errCUDAWire, i, w.Kind)
		}
		if len(loc) > cudaMaxLocation {
			return 0, nil, fmt.Errorf("%w: region %d: location too long", errCUDAWire, i)
		}
		w.Location = string(loc)
		switch {
		case len(h) == cudaIPCHandleSize && dev >= 0:
			w.CUDA = &CUDAMemory{Device: int(dev), IPCHandle: append([]byte(nil), h...), Offset: off}
		case len(h) == 0 && dev == -1 && off == 0:
		default:
			return 0, nil, fmt.Errorf("%w: region %d: bad CUDA info", errCUDAWire, i)
		}
		if w.Kind == MemShared && (w.CUDA != nil || cudaShmPath(w.Location) != nil) {
			return 0, nil, fmt.Errorf("%w: region %d: shared memory without a file path", errCUDAWire, i)
		}
		if w.Kind == MemCUDA && w.CUDA == nil && w.Ptr == 0 {
			return 0, nil, fmt.Errorf("%w: region %d: device region without handle", errCUDAWire, i)
		}
		regs = append(regs, w)
	}
	if len(r.b) != 0 {
		return 0, nil, fmt.Errorf("%w: %d trailing bytes", errCUDAWire, len(r.b))
	}
	sort.Slice(regs, func(i, j int) bool { return regs[i].Addr < regs[j].Addr })
	for i := 1; i < len(regs); i++ {
		if regs[i].Addr < regs[i-1].Addr+regs[i-1].Len {
			return 0, nil, fmt.Errorf("%w: regions overlap at %#x", errCUDAWire, regs[i].Addr)
		}
	}
	return pid, regs, nil
}

func cudaWriteFrame(w io.Writer, payload []byte) error {
	b := make([]byte, 4, 4+len(payload))
	binary.BigEndian.PutUint32(b, uint32(len(payload)))
	_, err := w.Write(append(b, payload...))
	return err
}

func cudaReadFrame(r io.Reader) ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(h[:])
	if n > cudaMaxFrame {
		return nil, fmt.Errorf("%w: frame of %d bytes", errCUDAWire, n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return b, nil
}
