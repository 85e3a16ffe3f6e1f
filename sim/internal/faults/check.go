package faults

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// The history model: per session, a register holding the decode worker the session is
// resident on ("" = none). Operations, derived from what clients observed:
//
//   - Write(D): an acknowledged residency change. A request answered 200 whose stream ended
//     with [DONE], not failed open (X-KVC-Fail-Open false), with X-KVC-Mode SEED,
//     RESEED_SNAPSHOT or RESEED_PREFILL (SEED: see Seed) and X-KVC-Decode-Worker D: the control plane decided to
//     make the session resident on D, D served it, and the client got the whole answer. Its
//     interval is the request's [call, return].
//   - Seed(D): an acknowledged write made by a SEED decision. SEED is decided only for a
//     session the control plane has no residency for, so it also reads the register: legal only
//     when the register is "" (a SEED of a session acknowledged resident elsewhere means the
//     control plane forgot it).
//   - Read → D: a request answered 200 (not failed open) with X-KVC-Mode DIRECT_TO_D on D (the
//     control plane found the session resident on D), and every AdminService/GetSession on
//     the leader at a quiescent point ("" when not resident or unknown).
//   - Maybe(D): a request that failed (or timed out) after a decision of a write mode on D, a
//     failed DIRECT_TO_D, or a PD_FALLBACK decision: the register may become D (writes only),
//     stay, or become "" (the control plane drops residency on a failed outcome). Pending
//     operations are kept, not dropped (porcupine needs them). Every attempt the gateway
//     retried through a new decision (X-KVC-Retried-From, X-KVC-Resumed-Retried-From) is a
//     Maybe(D) of its decode worker D too, over its request's interval.
//   - Write(D) too: a re-home, the control plane making a session resident on D from its
//     snapshot after its decode worker died (the leader's "session re-homed" log line; no
//     client request).
//   - Drop(D): a fault that legitimately forgets sessions on D (its kvc-sim killed: the KV is
//     gone). Over the fault's window the register may become "" if it held D.
//
// Fail-open answers (no decision) neither read nor write the register.
type opKind int

const (
	opWrite opKind = iota
	opRead
	opMaybe
	opDrop
	opSeed
)

func (k opKind) String() string {
	return [...]string{"write", "read", "maybe", "drop", "seed"}[k]
}

// Op is one operation of a session's history.
type Op struct {
	Session string
	Kind    opKind
	Worker  string // write/maybe/drop: the worker; read: the value read
	Call    time.Time
	Return  time.Time
	Source  string // what produced it (request, getsession, fault)
}

type regInput struct {
	kind   opKind
	worker string
}

// registerModel is the per-session residency register (nondeterministic for maybe and drop).
var registerModel = porcupine.NondeterministicModel{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation { return [][]porcupine.Operation{h} },
	Init:      func() []any { return []any{""} },
	Step: func(state, input, output any) []any {
		s, in := state.(string), input.(regInput)
		switch in.kind {
		case opWrite:
			return []any{in.worker}
		case opSeed:
			if s == "" {
				return []any{in.worker}
			}
			return nil
		case opRead:
			if output.(string) == s {
				return []any{s}
			}
			return nil
		case opMaybe:
			out := []any{s}
			if s != "" {
				out = append(out, "")
			}
			if in.worker != "" && in.worker != s {
				out = append(out, in.worker)
			}
			return out
		case opDrop:
			if s == in.worker && s != "" {
				return []any{s, ""}
			}
			return []any{s}
		}
		return nil
	},
	DescribeOperation: func(input, output any) string {
		in := input.(regInput)
		if in.kind == opRead {
			return fmt.Sprintf("read -> %q", output)
		}
		return fmt.Sprintf("%s(%q)", in.kind, in.worker)
	},
}

// Verdict is the check of one scenario's history.
type Verdict struct {
	Sessions    int      // sessions checked
	Ops         int      // operations checked
	Writes      int      // acknowledged writes
	Illegal     []string // sessions whose history has no linearization
	Unknown     []string // sessions the checker gave up on (timeout)
	Lost        int      // acknowledged writes that a later read contradicted
	LostDetails []string
}

// CheckHistory checks each session's operations for linearizability against the register
// model (porcupine), and counts lost writes: an acknowledged Write(D) or Seed(D) followed —
// with no other write, seed, maybe or drop of that session overlapping or in between — by a
// read that returned something other than D, or by a Seed (which saw no residency).
func CheckHistory(ops []Op, timeout time.Duration) Verdict {
	return checkHistory(ops, timeout, "")
}

// CheckHistoryVisualize is CheckHistory that also writes porcupine's HTML visualization of
// each session found not linearizable to dir/<session>.html.
func CheckHistoryVisualize(ops []Op, timeout time.Duration, dir string) Verdict {
	return checkHistory(ops, timeout, dir)
}

func checkHistory(ops []Op, timeout time.Duration, visDir string) Verdict {
	by := map[string][]Op{}
	for _, o := range ops {
		by[o.Session] = append(by[o.Session], o)
	}
	ids := make([]string, 0, len(by))
	for id := range by {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	var v Verdict
	model := registerModel.ToModel()
	for _, id := range ids {
		h := by[id]
		v.Sessions++
		v.Ops += len(h)
		var base time.Time
		for _, o := range h {
			if base.IsZero() || o.Call.Before(base) {
				base = o.Call
			}
		}
		pops := make([]porcupine.Operation, 0, len(h))
		for i, o := range h {
			if o.Kind == opWrite || o.Kind == opSeed {
				v.Writes++
			}
			var out any = ""
			if o.Kind == opRead {
				out = o.Worker
			}
			pops = append(pops, porcupine.Operation{ClientId: i, Input: regInput{o.Kind, o.Worker}, Output: out,
				Call: int64(o.Call.Sub(base)), Return: int64(o.Return.Sub(base))})
		}
		res, info := porcupine.CheckOperationsVerbose(model, pops, timeout)
		switch res {
		case porcupine.Illegal:
			v.Illegal = append(v.Illegal, id)
			if visDir != "" {
				if err := os.MkdirAll(visDir, 0o755); err == nil {
					_ = porcupine.VisualizePath(model, info, filepath.Join(visDir, id+".html"))
				}
			}
		case porcupine.Unknown:
			v.Unknown = append(v.Unknown, id)
		}
		n, details := lostWrites(h)
		v.Lost += n
		v.LostDetails = append(v.LostDetails, details...)
	}
	return v
}

// lostWrites counts the writes of one session's history that a later read contradicts with
// nothing else of the session in between.
func lostWrites(h []Op) (int, []string) {
	lost := map[int]string{}
	for wi, w := range h {
		if w.Kind != opWrite && w.Kind != opSeed {
			continue
		}
		for ri, r := range h {
			read := r.Worker // what r observed: a read its value, a seed "not resident"
			if r.Kind == opSeed {
				read = ""
			}
			if (r.Kind != opRead && r.Kind != opSeed) || !r.Call.After(w.Return) || read == w.Worker {
				continue
			}
			clean := true
			for oi, o := range h {
				if oi == wi || oi == ri || o.Kind == opRead {
					continue
				}
				// o may take effect between w and r when its interval meets [w.call, r.return]
				// (closed intervals, as porcupine's).
				if !o.Return.Before(w.Call) && !o.Call.After(r.Return) {
					clean = false
					break
				}
			}
			if clean {
				lost[wi] = fmt.Sprintf("%s: %s %s acked at %s, then %s %s saw %q at %s",
					w.Session, w.Kind, w.Worker, w.Return.UTC().Format("15:04:05.000"), r.Source, r.Kind, read, r.Call.UTC().Format("15:04:05.000"))
				break
			}
		}
	}
	var out []string
	for _, d := range lost {
		out = append(out, d)
	}
	sort.Strings(out)
	return len(lost), out
}

// OpsFromResults turns client answers into history operations (see the model above). Every
// attempt of a request is an operation: an attempt the gateway retried (Result.RetriedFrom,
// ResumedRetriedFrom) is a failed decision on its decode worker, Maybe(D) over the request's
// interval (the gateway names only its worker: whatever its mode, a failure there may have left
// the session resident on D, kept it or dropped it), then the interrupted attempt of a resumed
// request, then the last attempt.
func OpsFromResults(rs []Result) []Op {
	var out []Op
	for _, r := range rs {
		for _, w := range slices.Concat(r.RetriedFrom, r.ResumedRetriedFrom) {
			out = append(out, Op{Session: r.Session, Kind: opMaybe, Worker: w, Call: r.Call, Return: r.Return, Source: "retried attempt"})
		}
		if r.ResumedFrom != "" {
			// Resumed mid-stream: the interrupted decision failed (a Maybe, as any failure),
			// then the continuation's decision is this result's (its mode and worker).
			first := r
			first.OK, first.Mode, first.Worker, first.FailOpen, first.ResumedFrom = false, r.FirstMode, r.ResumedFrom, r.FirstFailOpen, ""
			first.RetriedFrom, first.ResumedRetriedFrom = nil, nil // counted above
			out = append(out, OpsFromResults([]Result{first})...)
		}
		if r.FailOpen || r.Mode == "" {
			if !r.OK && r.Mode == "" && r.Status == 0 {
				// No answer at all: the decision (if any) is unknown: it may have written.
				out = append(out, Op{Session: r.Session, Kind: opMaybe, Call: r.Call, Return: r.Return, Source: "request"})
			}
			continue
		}
		o := Op{Session: r.Session, Worker: r.Worker, Call: r.Call, Return: r.Return, Source: "request"}
		switch {
		case r.Mode == "PD_FALLBACK":
			o.Kind, o.Worker = opMaybe, ""
		case !r.OK:
			o.Kind = opMaybe
			if r.Mode == "DIRECT_TO_D" {
				o.Worker = ""
			}
		case r.Mode == "DIRECT_TO_D":
			o.Kind = opRead
		case r.Mode == "SEED":
			o.Kind = opSeed
		case r.Mode == "RESEED_SNAPSHOT" || r.Mode == "RESEED_PREFILL":
			o.Kind = opWrite
		default:
			o.Kind, o.Worker = opMaybe, ""
		}
		out = append(out, o)
	}
	return out
}
