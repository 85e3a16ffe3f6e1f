package prefill

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// readerBounce is the pinned bounce buffer of one snapshot_kv read of a store in device memory.
const readerBounce = 64 << 20

// Mount adds the snapshot HTTP API to mux:
//
//	GET /v1/sessions/{sid}/snapshot_status → {"exists", "seqlen", "generation", "freshness_s", "bytes"}
//	GET /v1/sessions/{sid}/snapshot_kv     → the snapshot's bytes, buffer by buffer, tokens [0, seqlen)
//	GET /v1/snapshots                      → every snapshot held
func (s *Sidecar) Mount(mux *http.ServeMux) {
	mux.HandleFunc("GET /v1/sessions/{sid}/snapshot_status", s.httpStatus)
	mux.HandleFunc("GET /v1/sessions/{sid}/snapshot_kv", s.httpKV)
	mux.HandleFunc("GET /v1/snapshots", s.httpList)
	mux.HandleFunc("GET /v1/status", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Status())
	})
}

type snapshotStatus struct {
	SessionID  string  `json:"session_id"`
	Exists     bool    `json:"exists"`
	Seqlen     int64   `json:"seqlen"`
	Generation uint64  `json:"generation"`
	FreshnessS float64 `json:"freshness_s"`
	Bytes      int64   `json:"bytes"`
	Source     string  `json:"source_worker,omitempty"`
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, code int, stable, msg string) {
	writeJSON(w, code, map[string]any{"error": map[string]string{"code": stable, "message": msg}})
}

func (s *Sidecar) httpStatus(w http.ResponseWriter, r *http.Request) {
	sid := r.PathValue("sid")
	if err := kvcv1.ValidateID("session_id", sid); err != nil {
		httpError(w, http.StatusBadRequest, "bad_request", err.Error())
		return
	}
	out := snapshotStatus{SessionID: sid}
	if st := s.Store(); st != nil {
		if v, ok := st.Get(sid); ok {
			out = snapshotStatus{SessionID: sid, Exists: true, Seqlen: v.Seqlen, Generation: v.Generation,
				FreshnessS: time.Since(v.Updated).Seconds(), Bytes: v.Bytes, Source: v.Source}
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func (s *Sidecar) httpList(w http.ResponseWriter, _ *http.Request) {
	out := []snapshotStatus{}
	if st := s.Store(); st != nil {
		for _, v := range st.List() {
			out = append(out, snapshotStatus{SessionID: v.Session, Exists: true, Seqlen: v.Seqlen, Generation: v.Generation,
				FreshnessS: time.Since(v.Updated).Seconds(), Bytes: v.Bytes, Source: v.Source})
		}
	}
	writeJSON(w, http.StatusOK, out)
}

// httpKV streams the snapshot's KV (for verification and debugging): for each buffer (layer 0 K,
// layer 0 V, ...), tokens 0..seqlen-1, each ItemLen/PageSize bytes. The entry is pinned while
// streaming. A store in GPU memory (--store-memory cuda) is copied out through the engine, 64 MiB
// at a time, into a pinned bounce buffer.
func (s *Sidecar) httpKV(w http.ResponseWriter, r *http.Request) {
	sid := r.PathValue("sid")
	if err := kvcv1.ValidateID("session_id", sid); err != nil {
		httpError(w, http.StatusBadRequest, "bad_request", err.Error())
		return
	}
	st, arena, err := s.storeAndArena()
	if err != nil {
		httpError(w, http.StatusServiceUnavailable, "unavailable", err.Error())
		return
	}
	v, release, ok := st.Acquire(sid)
	if !ok {
		httpError(w, http.StatusNotFound, "snapshot_missing", "no snapshot of "+sid)
		return
	}
	defer release()
	var rd *store.Reader
	if !arena.HostVisible() {
		// A store in GPU memory: copy through the engine into a pinned bounce buffer.
		var err error
		if rd, err = store.NewReader(r.Context(), s.eng, readerBounce); err != nil {
			httpError(w, http.StatusServiceUnavailable, "unavailable", "store in device memory: cannot copy it out through the engine: "+err.Error())
			return
		}
		defer rd.Close()
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("X-Kvc-Seqlen", itoa(v.Seqlen))
	w.Header().Set("X-Kvc-Generation", itoa(int64(v.Generation)))
	w.Header().Set("X-Kvc-Token-Bytes", itoa(arena.TokenBytes()))
	w.Header().Set("Content-Length", itoa(v.Seqlen*arena.BytesPerToken()))
	if rd != nil {
		m := kvxfer.PageMap{Layout: arena.Layout(), Pages: v.Pages}
		for b := 0; b < arena.Buffers(); b++ {
			if err := rd.Tokens(r.Context(), m, b, 0, v.Seqlen, w); err != nil {
				s.log.Warn().Err(err).Str("session", sid).Msg("snapshot_kv from device memory cut short")
				return // the client sees a short body (Content-Length)
			}
		}
		return
	}
	for b := 0; b < arena.Buffers(); b++ {
		for t := int64(0); t < v.Seqlen; t++ {
			if _, err := w.Write(arena.TokenSlot(v.Pages, t, b)); err != nil {
				return
			}
		}
	}
}

func itoa(v int64) string {
	b, _ := json.Marshal(v)
	return string(b)
}
