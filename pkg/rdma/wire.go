package rdma

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// The tcp backend's wire format. Every frame is
//
//	u32 n (little endian) | u8 type | n-1 bytes of body
//
// On each connection the dialing side first sends HELLO and the owner answers HELLO_ACK (with its
// registered regions and KV layout shape); after that the dialer sends WRITE and READ frames and
// the owner answers each, in order, with WRITE_ACK or READ_RESP.
//
//	HELLO      magic u32 | version u16 | conn u16 | shape | name (u16 len + bytes)
//	HELLO_ACK  magic u32 | version u16 | status u8 | msg (u16 len + bytes) | shape |
//	           u32 count | count × (addr u64 | len u64 | kind u8 | location (u16 len + bytes))
//	shape      present u8 | page size u32 | item len u64 | layers u32
//	WRITE      id u64 | addr u64 | payload (n-17 bytes, 1..tcpMaxSlice)
//	WRITE_ACK  id u64 | status u8 | msg (u16 len + bytes)
//	READ       id u64 | addr u64 | length u32 (1..tcpMaxSlice)
//	READ_RESP  id u64 | status u8 | payload (status OK: the length asked) or msg (u16 len + bytes)
//	WRITE_ACK_UPTO  id u64: every WRITE in flight up to and including id succeeded
//	WRITE_BATCH  first id u64 | count u32 (1..tcpMaxBatch) | count × (addr u64 | len u32) |
//	             the payloads back to back (sum of len, at most tcpMaxBatchBytes); ids first..first+count-1
//
// Successful WRITEs are acknowledged cumulatively; a refused WRITE gets its own WRITE_ACK.
const (
	tcpWireMagic   = 0x5443564b // "KVCT"
	tcpWireVersion = 1

	tcpFtHello    = 1
	tcpFtHelloAck = 2
	tcpFtWrite    = 3
	tcpFtWriteAck = 4
	tcpFtRead     = 5
	tcpFtReadResp = 6
	// tcpFtWriteAckUpTo acknowledges every WRITE in flight up to and including an id.
	tcpFtWriteAckUpTo = 7
	// tcpFtWriteBatch carries several WRITEs: descriptors first, then the payloads back to back,
	// so the owner can land them with one readv straight into registered memory.
	tcpFtWriteBatch = 8

	tcpStOK          uint8 = 0
	tcpStOutOfBounds uint8 = 1
	tcpStInvalid     uint8 = 2
	tcpStVersion     uint8 = 3
	tcpStLayout      uint8 = 4

	tcpMaxSlice     = 16 << 20 // largest payload of one frame
	tcpMaxHandshake = 1 << 20  // largest HELLO / HELLO_ACK
	tcpMaxRegions   = 4096
	tcpMaxMsg       = 1024
	// A WRITE_BATCH holds at most tcpMaxBatch writes and tcpMaxBatchBytes of payload.
	tcpMaxBatch      = 1000
	tcpMaxBatchBytes = 16 << 20
	tcpMaxName       = 1024
)

var tcpErrProtocol = errors.New("rdma: tcp protocol error")

// tcpShape is the part of a KV layout two engines must agree on.
type tcpShape struct {
	present   bool
	pageSize  uint32
	itemLen   uint64
	numLayers uint32
}

func tcpShapeOf(l *Layout) tcpShape {
	if l == nil {
		return tcpShape{}
	}
	return tcpShape{true, uint32(l.PageSize), l.ItemLen, uint32(l.NumLayers)}
}

func (s tcpShape) compatible(o tcpShape) error {
	if !s.present || !o.present || s == o {
		return nil
	}
	return fmt.Errorf("%w: page size %d/%d, item length %d/%d, layers %d/%d", ErrLayoutMismatch,
		s.pageSize, o.pageSize, s.itemLen, o.itemLen, s.numLayers, o.numLayers)
}

type tcpHello struct {
	version  uint16
	conn     uint16
	tcpShape tcpShape
	name     string
}

type tcpHelloAck struct {
	version  uint16
	status   uint8
	msg      string
	tcpShape tcpShape
	regions  []Region
}

// tcpEnc appends little-endian fields.
type tcpEnc struct{ b []byte }

func (e *tcpEnc) u8(v uint8)   { e.b = append(e.b, v) }
func (e *tcpEnc) u16(v uint16) { e.b = binary.LittleEndian.AppendUint16(e.b, v) }
func (e *tcpEnc) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *tcpEnc) u64(v uint64) { e.b = binary.LittleEndian.AppendUint64(e.b, v) }
func (e *tcpEnc) str(s string, limit int) {
	if len(s) > limit {
		s = s[:limit]
	}
	e.u16(uint16(len(s)))
	e.b = append(e.b, s...)
}
func (e *tcpEnc) tcpShape(s tcpShape) {
	if !s.present {
		e.u8(0)
		e.u32(0)
		e.u64(0)
		e.u32(0)
		return
	}
	e.u8(1)
	e.u32(s.pageSize)
	e.u64(s.itemLen)
	e.u32(s.numLayers)
}

// tcpFrame starts a frame of type t; finish fills in its length.
func tcpFrame(t uint8) *tcpEnc { return &tcpEnc{b: []byte{0, 0, 0, 0, t}} }

func (e *tcpEnc) finish() []byte {
	binary.LittleEndian.PutUint32(e.b, uint32(len(e.b)-4))
	return e.b
}

// tcpDec reads little-endian fields; the first short read sets err and later reads return zero.
type tcpDec struct {
	b   []byte
	err error
}

func (d *tcpDec) take(n int) []byte {
	if d.err != nil {
		return nil
	}
	if n < 0 || len(d.b) < n {
		d.err = fmt.Errorf("%w: truncated tcpFrame", tcpErrProtocol)
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func (d *tcpDec) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}

func (d *tcpDec) u16() uint16 {
	if v := d.take(2); v != nil {
		return binary.LittleEndian.Uint16(v)
	}
	return 0
}

func (d *tcpDec) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}

func (d *tcpDec) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.LittleEndian.Uint64(v)
	}
	return 0
}

func (d *tcpDec) str(limit int) string {
	n := int(d.u16())
	if d.err == nil && n > limit {
		d.err = fmt.Errorf("%w: string of %d bytes", tcpErrProtocol, n)
		return ""
	}
	return string(d.take(n))
}

func (d *tcpDec) tcpShape() tcpShape {
	present := d.u8()
	s := tcpShape{pageSize: d.u32(), itemLen: d.u64(), numLayers: d.u32()}
	switch present {
	case 0:
		return tcpShape{}
	case 1:
		s.present = true
		if s.pageSize == 0 || s.itemLen == 0 || s.numLayers == 0 || s.itemLen%uint64(s.pageSize) != 0 {
			d.fail("invalid KV layout tcpShape")
		}
	default:
		d.fail("invalid tcpShape flag")
	}
	return s
}

func (d *tcpDec) fail(msg string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", tcpErrProtocol, msg)
	}
}

func (d *tcpDec) end() error {
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", tcpErrProtocol, len(d.b))
	}
	return d.err
}

func tcpEncodeHello(h tcpHello) []byte {
	e := tcpFrame(tcpFtHello)
	e.u32(tcpWireMagic)
	e.u16(h.version)
	e.u16(h.conn)
	e.tcpShape(h.tcpShape)
	e.str(h.name, tcpMaxName)
	return e.finish()
}

// tcpDecodeHello decodes a HELLO body (after the type byte).
func tcpDecodeHello(body []byte) (tcpHello, error) {
	d := &tcpDec{b: body}
	if d.u32() != tcpWireMagic && d.err == nil {
		d.fail("bad magic")
	}
	h := tcpHello{version: d.u16(), conn: d.u16(), tcpShape: d.tcpShape(), name: d.str(tcpMaxName)}
	return h, d.end()
}

func tcpEncodeHelloAck(a tcpHelloAck) []byte {
	e := tcpFrame(tcpFtHelloAck)
	e.u32(tcpWireMagic)
	e.u16(a.version)
	e.u8(a.status)
	e.str(a.msg, tcpMaxMsg)
	e.tcpShape(a.tcpShape)
	regs := a.regions
	if len(regs) > tcpMaxRegions {
		regs = regs[:tcpMaxRegions]
	}
	e.u32(uint32(len(regs)))
	for _, r := range regs {
		e.u64(r.Addr)
		e.u64(r.Len)
		e.u8(uint8(r.Kind))
		e.str(r.Location, tcpMaxName)
	}
	return e.finish()
}

// tcpDecodeHelloAck decodes a HELLO_ACK body (after the type byte). Regions are validated: non-empty,
// not wrapping, known kind.
func tcpDecodeHelloAck(body []byte) (tcpHelloAck, error) {
	d := &tcpDec{b: body}
	if d.u32() != tcpWireMagic && d.err == nil {
		d.fail("bad magic")
	}
	a := tcpHelloAck{version: d.u16(), status: d.u8(), msg: d.str(tcpMaxMsg), tcpShape: d.tcpShape()}
	n := d.u32()
	if d.err == nil && n > tcpMaxRegions {
		d.fail(fmt.Sprintf("%d regions", n))
	}
	for i := uint32(0); i < n && d.err == nil; i++ {
		r := Region{Addr: d.u64(), Len: d.u64(), Kind: MemKind(d.u8()), Location: d.str(tcpMaxName)}
		if d.err == nil && (r.Len == 0 || r.Addr+r.Len < r.Addr || r.Kind < MemHost || r.Kind > MemCUDA) {
			d.fail("invalid region")
		}
		a.regions = append(a.regions, r)
	}
	return a, d.end()
}

// tcpReadHeader reads a frame header and checks its length against the type's limits; it returns
// the body length (after the type byte).
func tcpReadHeader(r *bufio.Reader) (typ uint8, body uint32, err error) {
	var h [5]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, err
	}
	n := binary.LittleEndian.Uint32(h[:4])
	typ = h[4]
	if n == 0 {
		return 0, 0, fmt.Errorf("%w: empty tcpFrame", tcpErrProtocol)
	}
	body = n - 1
	var ok bool
	switch typ {
	case tcpFtHello, tcpFtHelloAck:
		ok = body <= tcpMaxHandshake
	case tcpFtWrite:
		ok = body >= 16 && body <= 16+tcpMaxSlice
	case tcpFtWriteAck:
		ok = body >= 11 && body <= 11+tcpMaxMsg
	case tcpFtRead:
		ok = body == 20
	case tcpFtReadResp:
		ok = body >= 9 && body <= 9+tcpMaxSlice
	case tcpFtWriteAckUpTo:
		ok = body == 8
	case tcpFtWriteBatch:
		ok = body >= 12+12 && body <= 12+12*tcpMaxBatch+tcpMaxBatchBytes
	default:
		return 0, 0, fmt.Errorf("%w: unknown tcpFrame type %d", tcpErrProtocol, typ)
	}
	if !ok {
		return 0, 0, fmt.Errorf("%w: tcpFrame type %d with %d bytes", tcpErrProtocol, typ, body)
	}
	return typ, body, nil
}

// tcpReadBody reads a small frame body.
func tcpReadBody(r *bufio.Reader, n uint32) ([]byte, error) {
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return b, err
}

// writeAck encodes a WRITE_ACK.
func tcpAppendWriteAck(b []byte, id uint64, status uint8, msg string) []byte {
	if len(msg) > tcpMaxMsg {
		msg = msg[:tcpMaxMsg]
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(1+8+1+2+len(msg)))
	b = append(b, tcpFtWriteAck)
	b = binary.LittleEndian.AppendUint64(b, id)
	b = append(b, status)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(msg)))
	return append(b, msg...)
}

func tcpAppendAckUpTo(b []byte, id uint64) []byte {
	b = binary.LittleEndian.AppendUint32(b, 1+8)
	b = append(b, tcpFtWriteAckUpTo)
	return binary.LittleEndian.AppendUint64(b, id)
}

// tcpStatusErr maps a wire status and message to an error.
func tcpStatusErr(status uint8, msg string) error {
	switch status {
	case tcpStOK:
		return nil
	case tcpStOutOfBounds:
		return fmt.Errorf("%w (refused by the owner: %s)", ErrOutOfBounds, msg)
	case tcpStInvalid:
		return fmt.Errorf("%w (refused by the owner: %s)", ErrInvalidRequest, msg)
	case tcpStLayout:
		return fmt.Errorf("%w (refused by the owner: %s)", ErrLayoutMismatch, msg)
	case tcpStVersion:
		return fmt.Errorf("%w: version refused by the owner: %s", tcpErrProtocol, msg)
	}
	return fmt.Errorf("%w: status %d: %s", tcpErrProtocol, status, msg)
}
