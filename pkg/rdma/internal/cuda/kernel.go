package cuda

// CopyKernelName is the entry point of CopyKernelPTX that runs one CTA per descriptor.
const CopyKernelName = "kvc_copy"

// WarpKernelName is the entry point of CopyKernelPTX that runs as a persistent grid: warp w of
// W copies descriptors w, w+W, … (launch it with about as many CTAs as fill the device once).
const WarpKernelName = "kvc_copy_warp"

// DescSize is the size in bytes of one copy descriptor {src, dst, len, reserved}, four
// little-endian uint64s. Addresses are generic (UVA) addresses: local device memory, peer
// device memory (peer access enabled), imported IPC memory or mapped pinned host memory.
const DescSize = 32

// CopyKernelPTX is the page-gather/scatter copy kernel, written by hand in PTX and JIT-compiled
// by the driver at run time (cuModuleLoadData). Parameters: (u64 descs, u32 n). Each CTA takes
// descriptors ctaid, ctaid+nctaid, …; its threads copy the descriptor's bytes with 16-byte vector
// loads and stores, four in flight per thread, when src, dst and len are 16-byte aligned, and
// byte by byte otherwise.
const CopyKernelPTX = `
.version 8.0
.target sm_90
.address_size 64

.visible .entry kvc_copy(
	.param .u64 p_descs,
	.param .u32 p_n
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .b64 %rd<32>;

	ld.param.u64 %rd1, [p_descs];
	ld.param.u32 %r1, [p_n];
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %nctaid.x;
	mov.u32 %r4, %tid.x;
	mov.u32 %r5, %ntid.x;
	mul.wide.u32 %rd20, %r4, 16;
	mul.wide.u32 %rd21, %r5, 16;
	shl.b64 %rd22, %rd21, 2;
	cvt.u64.u32 %rd23, %r4;
	cvt.u64.u32 %rd24, %r5;

DESC:
	setp.ge.u32 %p1, %r2, %r1;
	@%p1 bra DONE;
	mul.wide.u32 %rd2, %r2, 32;
	add.s64 %rd3, %rd1, %rd2;
	ld.u64 %rd4, [%rd3];
	ld.u64 %rd5, [%rd3+8];
	ld.u64 %rd6, [%rd3+16];
	or.b64 %rd7, %rd4, %rd5;
	or.b64 %rd7, %rd7, %rd6;
	and.b64 %rd7, %rd7, 15;
	setp.ne.s64 %p2, %rd7, 0;
	@%p2 bra BYTES;
	mov.u64 %rd8, %rd20;

QUAD:
	add.s64 %rd9, %rd8, %rd21;
	add.s64 %rd10, %rd9, %rd21;
	add.s64 %rd11, %rd10, %rd21;
	setp.ge.u64 %p3, %rd11, %rd6;
	@%p3 bra VEC;
	add.s64 %rd12, %rd4, %rd8;
	add.s64 %rd13, %rd4, %rd9;
	add.s64 %rd14, %rd4, %rd10;
	add.s64 %rd15, %rd4, %rd11;
	ld.v4.u32 {%r6, %r7, %r8, %r9}, [%rd12];
	ld.v4.u32 {%r10, %r11, %r12, %r13}, [%rd13];
	ld.v4.u32 {%r14, %r15, %r16, %r17}, [%rd14];
	ld.v4.u32 {%r18, %r19, %r20, %r21}, [%rd15];
	add.s64 %rd12, %rd5, %rd8;
	add.s64 %rd13, %rd5, %rd9;
	add.s64 %rd14, %rd5, %rd10;
	add.s64 %rd15, %rd5, %rd11;
	st.v4.u32 [%rd12], {%r6, %r7, %r8, %r9};
	st.v4.u32 [%rd13], {%r10, %r11, %r12, %r13};
	st.v4.u32 [%rd14], {%r14, %r15, %r16, %r17};
	st.v4.u32 [%rd15], {%r18, %r19, %r20, %r21};
	add.s64 %rd8, %rd8, %rd22;
	bra QUAD;

VEC:
	setp.ge.u64 %p3, %rd8, %rd6;
	@%p3 bra NEXT;
	add.s64 %rd12, %rd4, %rd8;
	ld.v4.u32 {%r6, %r7, %r8, %r9}, [%rd12];
	add.s64 %rd13, %rd5, %rd8;
	st.v4.u32 [%rd13], {%r6, %r7, %r8, %r9};
	add.s64 %rd8, %rd8, %rd21;
	bra VEC;

BYTES:
	mov.u64 %rd8, %rd23;
BLOOP:
	setp.ge.u64 %p3, %rd8, %rd6;
	@%p3 bra NEXT;
	add.s64 %rd12, %rd4, %rd8;
	ld.u8 %r6, [%rd12];
	add.s64 %rd13, %rd5, %rd8;
	st.u8 [%rd13], %r6;
	add.s64 %rd8, %rd8, %rd24;
	bra BLOOP;

NEXT:
	add.u32 %r2, %r2, %r3;
	bra DESC;

DONE:
	ret;
}

.visible .entry kvc_copy_warp(
	.param .u64 p_descs,
	.param .u32 p_n
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<48>;
	.reg .b64 %rd<32>;

	ld.param.u64 %rd1, [p_descs];
	ld.param.u32 %r1, [p_n];
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ntid.x;
	mov.u32 %r4, %tid.x;
	mov.u32 %r5, %nctaid.x;
	mad.lo.u32 %r6, %r2, %r3, %r4;
	shr.u32 %r7, %r6, 5;
	mul.lo.u32 %r8, %r5, %r3;
	shr.u32 %r9, %r8, 5;
	and.b32 %r10, %r4, 31;
	mul.wide.u32 %rd20, %r10, 16;
	cvt.u64.u32 %rd23, %r10;

WDESC:
	setp.ge.u32 %p1, %r7, %r1;
	@%p1 bra WDONE;
	mul.wide.u32 %rd2, %r7, 32;
	add.s64 %rd3, %rd1, %rd2;
	ld.u64 %rd4, [%rd3];
	ld.u64 %rd5, [%rd3+8];
	ld.u64 %rd6, [%rd3+16];
	or.b64 %rd7, %rd4, %rd5;
	or.b64 %rd7, %rd7, %rd6;
	and.b64 %rd7, %rd7, 15;
	setp.ne.s64 %p2, %rd7, 0;
	@%p2 bra WBYTES;
	mov.u64 %rd8, %rd20;

WOCT:
	add.s64 %rd9, %rd8, 3584;
	setp.ge.u64 %p3, %rd9, %rd6;
	@%p3 bra WVEC;
	add.s64 %rd12, %rd4, %rd8;
	ld.v4.u32 {%r11, %r12, %r13, %r14}, [%rd12];
	ld.v4.u32 {%r15, %r16, %r17, %r18}, [%rd12+512];
	ld.v4.u32 {%r19, %r20, %r21, %r22}, [%rd12+1024];
	ld.v4.u32 {%r23, %r24, %r25, %r26}, [%rd12+1536];
	ld.v4.u32 {%r27, %r28, %r29, %r30}, [%rd12+2048];
	ld.v4.u32 {%r31, %r32, %r33, %r34}, [%rd12+2560];
	ld.v4.u32 {%r35, %r36, %r37, %r38}, [%rd12+3072];
	ld.v4.u32 {%r39, %r40, %r41, %r42}, [%rd12+3584];
	add.s64 %rd13, %rd5, %rd8;
	st.v4.u32 [%rd13], {%r11, %r12, %r13, %r14};
	st.v4.u32 [%rd13+512], {%r15, %r16, %r17, %r18};
	st.v4.u32 [%rd13+1024], {%r19, %r20, %r21, %r22};
	st.v4.u32 [%rd13+1536], {%r23, %r24, %r25, %r26};
	st.v4.u32 [%rd13+2048], {%r27, %r28, %r29, %r30};
	st.v4.u32 [%rd13+2560], {%r31, %r32, %r33, %r34};
	st.v4.u32 [%rd13+3072], {%r35, %r36, %r37, %r38};
	st.v4.u32 [%rd13+3584], {%r39, %r40, %r41, %r42};
	add.s64 %rd8, %rd8, 4096;
	bra WOCT;

WVEC:
	setp.ge.u64 %p3, %rd8, %rd6;
	@%p3 bra WNEXT;
	add.s64 %rd12, %rd4, %rd8;
	ld.v4.u32 {%r11, %r12, %r13, %r14}, [%rd12];
	add.s64 %rd13, %rd5, %rd8;
	st.v4.u32 [%rd13], {%r11, %r12, %r13, %r14};
	add.s64 %rd8, %rd8, 512;
	bra WVEC;

WBYTES:
	mov.u64 %rd8, %rd23;
WBLOOP:
	setp.ge.u64 %p3, %rd8, %rd6;
	@%p3 bra WNEXT;
	add.s64 %rd12, %rd4, %rd8;
	ld.u8 %r11, [%rd12];
	add.s64 %rd13, %rd5, %rd8;
	st.u8 [%rd13], %r11;
	add.s64 %rd8, %rd8, 32;
	bra WBLOOP;

WNEXT:
	add.u32 %r7, %r7, %r9;
	bra WDESC;

WDONE:
	ret;
}
`
