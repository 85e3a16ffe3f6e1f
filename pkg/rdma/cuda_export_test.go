package rdma

// Hooks for the external GPU flow test (package rdma_test), which cannot live in package rdma
// because it uses kvpool, which imports rdma.

// ImportForTest returns this process's address of the allocation behind an IPC handle,
// importing it if needed.
func (e *CUDAEngine) ImportForTest(m *CUDAMemory) (uint64, error) { return e.importHandle(m) }

// EnablePeerForTest enables access from device a to device b.
func (e *CUDAEngine) EnablePeerForTest(a, b int) error { return e.ensurePeer(a, b) }

// SetOptionsForTest replaces the options between batches.
func (e *CUDAEngine) SetOptionsForTest(o CUDAOptions) error {
	if err := o.defaults(); err != nil {
		return err
	}
	e.opt = o
	return nil
}

// CUDADefaultsForTest fills in the default options.
func CUDADefaultsForTest(o CUDAOptions) (CUDAOptions, error) { return o, o.defaults() }
