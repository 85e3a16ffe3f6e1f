#include "textflag.h"

// func valgrindRequest(args *[6]uintptr) uintptr
//
// Valgrind's client request (valgrind.h's VALGRIND_DO_CLIENT_REQUEST_EXPR on amd64): RAX
// points at the request and its five arguments, RDX holds the default result, and the
// magic preamble (four rotations of RDI by 128 bits in all, then xchg rbx, rbx) is a no-op
// on the bare CPU; under valgrind it runs the request and leaves the result in RDX.
TEXT ·valgrindRequest(SB), NOSPLIT, $0-16
	MOVQ args+0(FP), AX
	XORQ DX, DX
	BYTE $0x48; BYTE $0xC1; BYTE $0xC7; BYTE $0x03 // rolq $3, %rdi
	BYTE $0x48; BYTE $0xC1; BYTE $0xC7; BYTE $0x0D // rolq $13, %rdi
	BYTE $0x48; BYTE $0xC1; BYTE $0xC7; BYTE $0x3D // rolq $61, %rdi
	BYTE $0x48; BYTE $0xC1; BYTE $0xC7; BYTE $0x33 // rolq $51, %rdi
	BYTE $0x48; BYTE $0x87; BYTE $0xDB             // xchgq %rbx, %rbx
	MOVQ DX, ret+8(FP)
	RET
