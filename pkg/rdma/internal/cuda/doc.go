// Package cuda is a minimal binding of the CUDA driver API (libcuda.so.1), loaded at run time
// with purego so that binaries build with CGO_ENABLED=0 and run on machines without CUDA (Load
// then reports ErrNoDriver). It covers what the cuda transfer backend needs: primary contexts,
// device and pinned host memory, CUDA IPC, peer access, streams, events, async copies, and
// loading and launching the hand-written PTX copy kernel (CopyKernelPTX).
package cuda
