package policybench

// valgrindRequest is a valgrind client request (valgrind_amd64.s): 0 when not under valgrind.
//
//go:noescape
func valgrindRequest(args *[6]uintptr) uintptr
