package kvcv1

// Validate implements the request validation of AdminService.GetDrainStatus.
func (r *GetDrainStatusRequest) Validate() error { return ValidateID("worker_id", r.GetWorkerId()) }

// Validate implements the request validation of AdminService.ForgetWorker.
func (r *ForgetWorkerRequest) Validate() error { return ValidateID("worker_id", r.GetWorkerId()) }
