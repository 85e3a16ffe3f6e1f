package trace

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// Limits on what a trace line may say.
const (
	MaxInputTokens  = 10_000_000
	MaxOutputTokens = 1_000_000
	BlockTokens     = 512
	// MinSharedBlocks is how many leading hash ids two requests must share to be one session.
	MinSharedBlocks = 3
	maxLineBytes    = 16 << 20
)

// Options control reading.
type Options struct {
	// MaxRequests keeps the first N valid requests (0 = all).
	MaxRequests int
	// Name labels the workload.
	Name string
}

// Stats says what the reader did.
type Stats struct {
	Lines, Valid      int
	BrokenLines       int // not JSON, or missing fields
	ImpossibleLengths int // lengths out of range or hash ids inconsistent with the input length
	OutOfOrder        int // timestamps going backwards (kept, sorted)
	FirstProblems     []string
}

type line struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int64   `json:"input_length"`
	OutputLength *int64   `json:"output_length"`
	HashIDs      []int64  `json:"hash_ids"`
}

type request struct {
	idx     int
	at      time.Duration
	in, out int64
	hashes  []int64
}

type node struct {
	children map[int64]*node
	last     int // index of the latest request passing through this node
}

func (s *Stats) problem(kind *int, lineNo int, msg string) {
	*kind++
	if len(s.FirstProblems) < 10 {
		s.FirstProblems = append(s.FirstProblems, fmt.Sprintf("line %d: %s", lineNo, msg))
	}
}

// Read parses a Mooncake trace and rebuilds its sessions.
func Read(r io.Reader, opt Options) (*workload.Workload, Stats, error) {
	var st Stats
	br := bufio.NewReaderSize(r, 1<<20)
	var reqs []request
	var lastTS float64
	for lineNo := 1; ; lineNo++ {
		raw, err := readLine(br)
		if errors.Is(err, io.EOF) && len(raw) == 0 {
			break
		}
		if err != nil && !errors.Is(err, io.EOF) {
			if errors.Is(err, errLineTooLong) {
				st.Lines++
				st.problem(&st.BrokenLines, lineNo, "line longer than 16 MiB")
				continue
			}
			return nil, st, fmt.Errorf("reading trace: %w", err)
		}
		if len(raw) == 0 {
			continue
		}
		st.Lines++
		var l line
		if jerr := json.Unmarshal(raw, &l); jerr != nil {
			st.problem(&st.BrokenLines, lineNo, "not a JSON object: "+jerr.Error())
			continue
		}
		if l.Timestamp == nil || l.InputLength == nil || l.OutputLength == nil {
			st.problem(&st.BrokenLines, lineNo, "missing timestamp, input_length or output_length")
			continue
		}
		in, out, ts := *l.InputLength, *l.OutputLength, *l.Timestamp
		switch {
		case in < 1 || in > MaxInputTokens:
			st.problem(&st.ImpossibleLengths, lineNo, fmt.Sprintf("input_length %d out of [1, %d]", in, MaxInputTokens))
			continue
		case out < 1 || out > MaxOutputTokens:
			st.problem(&st.ImpossibleLengths, lineNo, fmt.Sprintf("output_length %d out of [1, %d]", out, MaxOutputTokens))
			continue
		case ts < 0 || ts > 1e12 || ts != ts:
			st.problem(&st.ImpossibleLengths, lineNo, fmt.Sprintf("timestamp %v impossible", ts))
			continue
		case int64(len(l.HashIDs)) > (in+BlockTokens-1)/BlockTokens:
			st.problem(&st.ImpossibleLengths, lineNo, fmt.Sprintf("%d hash blocks cannot cover only %d tokens", len(l.HashIDs), in))
			continue
		}
		if ts < lastTS {
			st.OutOfOrder++
		}
		lastTS = max(lastTS, ts)
		reqs = append(reqs, request{idx: len(reqs), at: time.Duration(ts * float64(time.Millisecond)), in: in, out: out, hashes: l.HashIDs})
		if opt.MaxRequests > 0 && len(reqs) >= opt.MaxRequests {
			break
		}
	}
	st.Valid = len(reqs)
	sort.SliceStable(reqs, func(i, j int) bool { return reqs[i].at < reqs[j].at })
	for i := range reqs {
		reqs[i].idx = i
	}
	w := rebuild(reqs)
	w.Name = opt.Name
	if w.Name == "" {
		w.Name = "mooncake"
	}
	w.Notes = append(w.Notes, fmt.Sprintf("%d lines, %d valid requests, %d broken lines skipped, %d impossible lengths skipped, %d out-of-order timestamps",
		st.Lines, st.Valid, st.BrokenLines, st.ImpossibleLengths, st.OutOfOrder))
	w.Notes = append(w.Notes, st.FirstProblems...)
	return w, st, nil
}

var errLineTooLong = errors.New("line too long")

func readLine(br *bufio.Reader) ([]byte, error) {
	var buf []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if len(buf)+len(chunk) > maxLineBytes {
			// Skip the rest of the line.
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = br.ReadSlice('\n')
			}
			return nil, errLineTooLong
		}
		buf = append(buf, chunk...)
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		for len(buf) > 0 && (buf[len(buf)-1] == '\n' || buf[len(buf)-1] == '\r' || buf[len(buf)-1] == ' ') {
			buf = buf[:len(buf)-1]
		}
		return buf, err
	}
}

// rebuild groups requests (sorted by time) into sessions by shared leading hash ids.
func rebuild(reqs []request) *workload.Workload {
	root := &node{children: map[int64]*node{}}
	session := make([]int, len(reqs)) // request -> session index
	var sessions []workload.Session
	for i, r := range reqs {
		// Deepest match along this request's hash ids.
		n, depth, match := root, 0, -1
		for _, h := range r.hashes {
			c, ok := n.children[h]
			if !ok {
				break
			}
			n, depth, match = c, depth+1, c.last
		}
		if depth >= MinSharedBlocks && match >= 0 {
			si := session[match]
			session[i] = si
			sessions[si].Turns = append(sessions[si].Turns, workload.Turn{At: r.at, InputTokens: r.in, OutputTokens: r.out})
		} else {
			session[i] = len(sessions)
			sessions = append(sessions, workload.Session{
				ID: fmt.Sprintf("mc-%05d", len(sessions)), Start: r.at,
				Turns: []workload.Turn{{At: r.at, InputTokens: r.in, OutputTokens: r.out}},
			})
		}
		// Insert this request's path.
		n = root
		for _, h := range r.hashes {
			c, ok := n.children[h]
			if !ok {
				c = &node{children: map[int64]*node{}}
				n.children[h] = c
			}
			c.last = i
			n = c
		}
	}
	return &workload.Workload{Sessions: sessions}
}
