package kvxfer

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// regRequest describes kp (MHA or MLA, by its spec) for RegisterKVPool.
func regRequest(kp *kvpool.Pool) *kvcv1.RegisterKVPoolRequest {
	sp := kp.Spec()
	r := &kvcv1.RegisterKVPoolRequest{PageSize: int32(sp.PageSize), ItemLen: int64(sp.ItemLen), PageCount: sp.PageCount, NumLayers: int32(sp.NumLayers)}
	if sp.MLA {
		r.Layout = kvcv1.PoolLayout_POOL_LAYOUT_MLA
	}
	for i := 0; i < kp.NumBuffers(); i++ {
		layer, k := int32(i/2), kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			k = kvcv1.KVKind_KV_KIND_V
		}
		if sp.MLA {
			layer, k = int32(i), kvcv1.KVKind_KV_KIND_COMBINED
		}
		r.Buffers = append(r.Buffers, &kvcv1.KVBuffer{Layer: layer, Kind: k, SizeBytes: int64(sp.ItemLen) * sp.PageCount,
			Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: kp.Path(), Offset: kp.Offset(i)}}})
	}
	return r
}

func TestRegistrationShape(t *testing.T) {
	mha, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 64, NumLayers: 3, PageCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer mha.Close()
	mla, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 64, NumLayers: 3, PageCount: 16, MLA: true})
	if err != nil {
		t.Fatal(err)
	}
	defer mla.Close()
	tests := []struct {
		name    string
		pool    *kvpool.Pool
		mod     func(r *kvcv1.RegisterKVPoolRequest)
		want    codes.Code
		msg     string
		buffers int
	}{
		{"mha", mha, func(*kvcv1.RegisterKVPoolRequest) {}, codes.OK, "", 6},
		{"mha explicit", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.Layout = kvcv1.PoolLayout_POOL_LAYOUT_MHA }, codes.OK, "", 6},
		{"mla", mla, func(*kvcv1.RegisterKVPoolRequest) {}, codes.OK, "", 3},
		{"mla without layout", mla, func(r *kvcv1.RegisterKVPoolRequest) { r.Layout = 0 }, codes.InvalidArgument, "must say layout POOL_LAYOUT_MLA", 0},
		{"mla layout, mha buffers", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.Layout = kvcv1.PoolLayout_POOL_LAYOUT_MLA }, codes.InvalidArgument, "look like an MHA pool", 0},
		{"mla wrong kind", mla, func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[1].Kind = kvcv1.KVKind_KV_KIND_K }, codes.InvalidArgument, "want layer 1 KV_KIND_COMBINED", 0},
		{"mla wrong layer", mla, func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[2].Layer = 0 }, codes.InvalidArgument, "buffer 2 is layer 0", 0},
		{"mha combined kind", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.Buffers[0].Kind = kvcv1.KVKind_KV_KIND_COMBINED }, codes.InvalidArgument, "want layer 0 KV_KIND_K", 0},
		{"unknown layout", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.Layout = 9 }, codes.InvalidArgument, "unknown pool layout", 0},
		{"tp", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.TpRank, r.TpSize = 3, 4 }, codes.OK, "", 6},
		{"tp rank = size", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.TpRank, r.TpSize = 4, 4 }, codes.InvalidArgument, "tp_rank 4 must be below tp_size 4", 0},
		{"tp rank without size", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.TpRank = 1 }, codes.InvalidArgument, "without tp_size", 0},
		{"tp negative", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.TpRank, r.TpSize = -1, 2 }, codes.InvalidArgument, "negative", 0},
		{"tp too large", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.TpSize = MaxTPSize + 1 }, codes.InvalidArgument, "tp_size", 0},
		{"aux lens", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.AuxItemLens = []int64{64, 8, 4096} }, codes.OK, "", 6},
		{"aux len 0", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.AuxItemLens = []int64{64, 0} }, codes.InvalidArgument, "aux_item_lens[1]", 0},
		{"aux len too large", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.AuxItemLens = []int64{MaxAuxBytes + 1} }, codes.InvalidArgument, "aux_item_lens[0]", 0},
		{"too many aux", mha, func(r *kvcv1.RegisterKVPoolRequest) { r.AuxItemLens = make([]int64, MaxAuxBuffers+1) }, codes.InvalidArgument, "aux buffers", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := regRequest(tt.pool)
			tt.mod(r)
			p, err := MapPool(r)
			if status.Code(err) != tt.want || (tt.msg != "" && !strings.Contains(err.Error(), tt.msg)) {
				t.Fatalf("got %v, want %v %q", err, tt.want, tt.msg)
			}
			if err != nil {
				return
			}
			defer p.Close()
			if p.Buffers() != tt.buffers || len(p.Layout().GetBufferAddrs()) != tt.buffers || p.TPRank != r.TpRank || p.TPSize != max(r.TpSize, 1) {
				t.Fatalf("pool: %d buffers, layout %d addrs, tp %s", p.Buffers(), len(p.Layout().GetBufferAddrs()), p.TPString())
			}
			if p.MLA != (r.Layout == kvcv1.PoolLayout_POOL_LAYOUT_MLA) || LayoutIsMLA(p.Layout()) != p.MLA {
				t.Fatalf("MLA %v for layout %v", p.MLA, r.Layout)
			}
		})
	}
}

func TestCheckAux(t *testing.T) {
	free := &Pool{}
	sized := &Pool{AuxItemLens: []int64{8, 4}}
	tests := []struct {
		name string
		p    *Pool
		aux  [][]byte
		msg  string
	}{
		{"none", sized, nil, ""},
		{"none, unsized pool", free, nil, ""},
		{"any rows, unsized pool", free, [][]byte{make([]byte, 100), {1}}, ""},
		{"too many bytes", free, [][]byte{make([]byte, MaxAuxBytes), {1}}, "at most 65536"},
		{"exact", sized, [][]byte{make([]byte, 8), make([]byte, 4)}, ""},
		{"short rows", sized, [][]byte{{1}, {}}, ""},
		{"row too long", sized, [][]byte{make([]byte, 8), make([]byte, 5)}, "aux row 1 is 5 bytes"},
		{"wrong count", sized, [][]byte{{1}}, "1 aux rows; the pool registered 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.p.CheckAux(tt.aux)
			if tt.msg == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.msg) {
				t.Fatalf("got %v, want InvalidArgument %q", err, tt.msg)
			}
		})
	}
}

func TestCompatibleLayoutsMLA(t *testing.T) {
	mha := &kvcv1.KVLayout{PageSize: 4, ItemLen: 64, NumLayers: 2, BufferAddrs: []uint64{1, 2, 3, 4}, PageCount: 8}
	mla := &kvcv1.KVLayout{PageSize: 4, ItemLen: 64, NumLayers: 2, BufferAddrs: []uint64{1, 2}, PageCount: 8}
	bad := &kvcv1.KVLayout{PageSize: 4, ItemLen: 64, NumLayers: 2, BufferAddrs: []uint64{1, 2, 3}, PageCount: 8}
	if err := CompatibleLayouts(mla, mla); err != nil {
		t.Fatal(err)
	}
	if err := CompatibleLayouts(mha, mha); err != nil {
		t.Fatal(err)
	}
	for _, pair := range [][2]*kvcv1.KVLayout{{mha, mla}, {mla, mha}} {
		err := CompatibleLayouts(pair[0], pair[1])
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "MLA") || !strings.Contains(err.Error(), "MHA") {
			t.Fatalf("MHA vs MLA: %v", err)
		}
	}
	if err := CompatibleLayouts(bad, mha); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("malformed: %v", err)
	}
	// Runs over an MLA pair cover one buffer per layer.
	plan, err := PlanRuns(PageMap{Layout: mla, Pages: []int64{0, 1}}, PageMap{Layout: mla, Pages: []int64{3, 4}}, 0, 8)
	if err != nil {
		t.Fatal(err)
	}
	if plan.Len() != 2 || plan.Bytes() != 2*2*64 {
		t.Fatalf("plan: %d requests, %d bytes", plan.Len(), plan.Bytes())
	}
}

func TestCheckPeerTP(t *testing.T) {
	mine := &Pool{TPRank: 1, TPSize: 2}
	in := func(p *Pool) context.Context {
		md, _ := metadata.FromOutgoingContext(WithTP(context.Background(), p))
		return metadata.NewIncomingContext(context.Background(), md)
	}
	if err := CheckPeerTP(in(&Pool{TPRank: 1, TPSize: 2}), mine); err != nil {
		t.Fatal(err)
	}
	if err := CheckPeerTP(in(&Pool{TPRank: 0, TPSize: 4}), mine); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "unequal TP") {
		t.Fatalf("unequal size: %v", err)
	}
	if err := CheckPeerTP(in(&Pool{TPRank: 0, TPSize: 2}), mine); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "rank r with rank r") {
		t.Fatalf("other rank: %v", err)
	}
	// An older sidecar sends nothing: rank 0 of 1.
	if err := CheckPeerTP(context.Background(), &Pool{}); err != nil {
		t.Fatal(err)
	}
	if err := CheckPeerTP(context.Background(), mine); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("no metadata vs TP 2: %v", err)
	}
	bad := metadata.NewIncomingContext(context.Background(), metadata.Pairs(tpMetadataKey, "3/2"))
	if err := CheckPeerTP(bad, mine); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("bad metadata: %v", err)
	}
}

func TestHelloTP(t *testing.T) {
	tests := []struct {
		name             string
		pool             *Pool
		group, url       string
		wantGroup        string
		wantRank, wantSz int32
	}{
		{"no pool yet", nil, "g", "http://w:30000", "", 0, 0},
		{"no tensor parallelism", &Pool{}, "", "http://w:30000", "", 0, 1},
		{"tp 1 with a group", &Pool{TPSize: 1}, "g", "http://w:30000", "g", 0, 1},
		{"group flag", &Pool{TPRank: 1, TPSize: 2}, "dec-a", "http://w:30000", "dec-a", 1, 2},
		{"default: the worker url", &Pool{TPRank: 3, TPSize: 4}, "", "http://w:30000", "http://w:30000", 3, 4},
		{"no group, no url", &Pool{TPRank: 1, TPSize: 2}, "", "", "", 1, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := &kvcv1.Hello{WorkerUrl: tt.url}
			HelloTP(h, tt.pool, tt.group)
			if h.GetTpGroup() != tt.wantGroup || h.GetTpRank() != tt.wantRank || h.GetTpSize() != tt.wantSz {
				t.Fatalf("hello tp %q %d/%d, want %q %d/%d", h.GetTpGroup(), h.GetTpRank(), h.GetTpSize(), tt.wantGroup, tt.wantRank, tt.wantSz)
			}
		})
	}
}

func TestCheckTPUnchanged(t *testing.T) {
	tests := []struct {
		name     string
		old, new *Pool
		ok       bool
	}{
		{"first registration", nil, &Pool{TPRank: 1, TPSize: 2}, true},
		{"same shape", &Pool{TPRank: 1, TPSize: 2}, &Pool{TPRank: 1, TPSize: 2}, true},
		{"no tp, 0 and 1 alike", &Pool{TPSize: 0}, &Pool{TPSize: 1}, true},
		{"other rank", &Pool{TPRank: 1, TPSize: 2}, &Pool{TPRank: 0, TPSize: 2}, false},
		{"other size", &Pool{TPRank: 1, TPSize: 2}, &Pool{TPRank: 1, TPSize: 4}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := CheckTPUnchanged(tt.old, tt.new)
			if tt.ok != (err == nil) || (err != nil && (status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "restart the sidecar"))) {
				t.Fatalf("CheckTPUnchanged: %v (want ok=%v)", err, tt.ok)
			}
		})
	}
}

// FuzzPeerTP: any kvc-tp metadata value is accepted only as "<rank>/<size>" with
// 0 ≤ rank < size, and otherwise refused with INVALID_ARGUMENT or FAILED_PRECONDITION; never a
// panic.
func FuzzPeerTP(f *testing.F) {
	for _, s := range []string{"0/1", "1/2", "3/2", "-1/2", "1/0", "", "x", "1/2/3", "99999999999999999999/1", " 1/2"} {
		f.Add(s)
	}
	mine := &Pool{TPRank: 1, TPSize: 2}
	f.Fuzz(func(t *testing.T, v string) {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(tpMetadataKey, v))
		err := CheckPeerTP(ctx, mine)
		switch status.Code(err) {
		case codes.OK:
			var r, s int
			if n, _ := fmt.Sscanf(v, "%d/%d", &r, &s); n != 2 || r != 1 || s != 2 {
				t.Fatalf("%q accepted", v)
			}
		case codes.InvalidArgument, codes.FailedPrecondition:
		default:
			t.Fatalf("%q: %v", v, err)
		}
	})
}
