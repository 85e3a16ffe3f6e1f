package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"time"
)

// Turn is one request of a session.
type Turn struct {
	// At is the earliest start, as an offset from the start of the run (open-loop arrival
	// time; 0 = no constraint).
	At time.Duration
	// Think is the pause after the previous turn's answer before this turn is sent.
	Think time.Duration
	// InputTokens is the whole input of the turn (context + new append).
	InputTokens int64
	// OutputTokens is how many tokens the turn asks for.
	OutputTokens int64
	// Edit, when set, says the client edited its history before this turn: the context is
	// the previous turn's context (its input and answer) edited, then the new append.
	Edit *Edit
}

// Kinds of history edits agent frameworks make.
const (
	// EditStripReasoning drops the reasoning part of the previous answer (Qwen3's template does
	// this to every answer before the last user turn; so do agent frameworks).
	EditStripReasoning = "strip_reasoning"
	// EditCompaction replaces a span of old turns with a short summary.
	EditCompaction = "compaction"
)

// Edit is one history edit: Remove tokens of the previous context from position At on are
// replaced by Insert new tokens.
type Edit struct {
	Kind           string
	At             int64
	Remove, Insert int64
}

// Session is one multi-turn conversation; its turns run one after another.
type Session struct {
	ID    string
	Start time.Duration
	Turns []Turn
	// SharedPrefix tokens at the start of every turn's context (a system prompt, tool
	// definitions) are the same in every session of SharedGroup ("" = none).
	SharedGroup  string
	SharedPrefix int64
}

// Workload is a set of sessions.
type Workload struct {
	Name     string
	Sessions []Session
	// Notes are human-readable lines about how it was built (skipped lines and so on).
	Notes []string
}

// Requests is the number of turns of all sessions.
func (w *Workload) Requests() int {
	n := 0
	for _, s := range w.Sessions {
		n += len(s.Turns)
	}
	return n
}

// Stats summarises a workload for reports.
type Stats struct {
	Sessions, Requests, MultiTurnSessions int
	MaxTurns                              int
	MeanAppend, MedianAppend              float64 // continuing turns: input - previous input - previous output
	MeanInput, MaxInput                   float64
	MeanOutput                            float64
	Span                                  time.Duration // last session start
	// EditedTurns are turns whose history was edited; SharedPromptSessions sessions that share
	// a system prompt with another.
	EditedTurns, SharedPromptSessions int
}

// Describe computes Stats.
func (w *Workload) Describe() Stats {
	st := Stats{Sessions: len(w.Sessions)}
	var appends []float64
	var inSum, outSum float64
	for _, s := range w.Sessions {
		if s.SharedGroup != "" {
			st.SharedPromptSessions++
		}
		st.Requests += len(s.Turns)
		if len(s.Turns) > 1 {
			st.MultiTurnSessions++
		}
		st.MaxTurns = max(st.MaxTurns, len(s.Turns))
		if s.Start > st.Span {
			st.Span = s.Start
		}
		for i, t := range s.Turns {
			inSum += float64(t.InputTokens)
			outSum += float64(t.OutputTokens)
			st.MaxInput = math.Max(st.MaxInput, float64(t.InputTokens))
			if i > 0 && t.Edit == nil {
				p := s.Turns[i-1]
				appends = append(appends, float64(t.InputTokens-p.InputTokens-p.OutputTokens))
			}
			if t.Edit != nil {
				st.EditedTurns++
			}
		}
	}
	if st.Requests > 0 {
		st.MeanInput, st.MeanOutput = inSum/float64(st.Requests), outSum/float64(st.Requests)
	}
	if len(appends) > 0 {
		sort.Float64s(appends)
		sum := 0.0
		for _, a := range appends {
			sum += a
		}
		st.MeanAppend, st.MedianAppend = sum/float64(len(appends)), appends[len(appends)/2]
	}
	return st
}

// AgenticConfig parameterises the built-in generator. Token counts are model tokens; times are
// workload time (kvc-bench's --time-scale multiplies them).
type AgenticConfig struct {
	Seed     uint64
	Sessions int
	// Session starts are spread uniformly (sorted random) over ArrivalSpan.
	ArrivalSpan time.Duration
	// ArrivalSpacing > 0: session i starts at i × ArrivalSpacing instead (runs that time single
	// turns without overlap, such as deploy/gpu/run-fromsnap.sh).
	ArrivalSpacing time.Duration
	// Turns per session, uniform in [MinTurns, MaxTurns].
	MinTurns, MaxTurns int
	// First-turn context (system prompt, task, repository files), log-uniform in [Min, Max].
	InitialMin, InitialMax int64
	// New tokens appended per turn (tool output, user message): exponential with this mean,
	// clipped to [16, 4096].
	AppendMean float64
	// Probability that a turn appends a large block (a big file or log), uniform in
	// [LargeAppendMin, LargeAppendMax]; above the direct-to-D limit these are "real large
	// appends".
	LargeAppendProb                float64
	LargeAppendMin, LargeAppendMax int64
	// Output tokens per turn: exponential with this mean, clipped to [8, OutputMax].
	OutputMean float64
	OutputMax  int64
	// Think time between turns: uniform in [ThinkMin, ThinkMax]; with LongThinkProb a long
	// pause (a slow tool, a human) uniform in [LongThinkMin, LongThinkMax].
	ThinkMin, ThinkMax         time.Duration
	LongThinkProb              float64
	LongThinkMin, LongThinkMax time.Duration
	// EditProb is the probability that a continuing turn edits the history first: with
	// EditStripProb the reasoning (half) of the previous answer is stripped, otherwise a span
	// of old turns is compacted into a summary a tenth of its size.
	EditProb, EditStripProb float64
	// SharedPrompts system prompts of SharedPromptMin–SharedPromptMax tokens are shared by
	// the sessions (session i uses prompt i mod SharedPrompts); 0 = none.
	SharedPrompts                    int
	SharedPromptMin, SharedPromptMax int64
}

// DefaultAgentic is the demo workload: 10 sessions of 14-26 turns (about 200 requests),
// first-turn contexts of 10K-30K tokens growing by ~341 appended tokens (plus the previous answer)
// per turn to tens of thousands, agent think times of 1-6 s with occasional long pauses — the
// pauses are what lets a full decode worker evict a session that then needs a reseed. About 1%
// of the turns append 9K-16K tokens (a big file or log), above the direct-to-D limit: with seed
// 1, two real large appends (docs/routing.md §1: PD_FALLBACK onto the session's own D).
func DefaultAgentic() AgenticConfig {
	return AgenticConfig{
		Seed: 1, Sessions: 10, ArrivalSpan: 30 * time.Second,
		MinTurns: 14, MaxTurns: 26,
		InitialMin: 10000, InitialMax: 30000,
		AppendMean:      341,
		LargeAppendProb: 0.01, LargeAppendMin: 9000, LargeAppendMax: 16000,
		OutputMean: 80, OutputMax: 512,
		ThinkMin: 1 * time.Second, ThinkMax: 6 * time.Second,
		LongThinkProb: 0.05, LongThinkMin: 10 * time.Second, LongThinkMax: 25 * time.Second,
		EditProb: 0.04, EditStripProb: 0.7,
		SharedPrompts: 3, SharedPromptMin: 6000, SharedPromptMax: 9500,
	}
}

// Validate checks c.
func (c AgenticConfig) Validate() error {
	switch {
	case c.Sessions < 1 || c.Sessions > 1_000_000:
		return fmt.Errorf("sessions must be in [1, 1000000], got %d", c.Sessions)
	case c.MinTurns < 1 || c.MaxTurns < c.MinTurns || c.MaxTurns > 10_000:
		return fmt.Errorf("turns range [%d, %d] invalid", c.MinTurns, c.MaxTurns)
	case c.InitialMin < 1 || c.InitialMax < c.InitialMin:
		return fmt.Errorf("initial context range [%d, %d] invalid", c.InitialMin, c.InitialMax)
	case c.AppendMean <= 0 || c.OutputMean <= 0 || c.OutputMax < 8:
		return fmt.Errorf("append mean, output mean and output max must be positive")
	case c.LargeAppendProb < 0 || c.LargeAppendProb > 1 || c.LongThinkProb < 0 || c.LongThinkProb > 1:
		return fmt.Errorf("probabilities must be in [0, 1]")
	case c.LargeAppendMin < 1 || c.LargeAppendMax < c.LargeAppendMin:
		return fmt.Errorf("large append range [%d, %d] invalid", c.LargeAppendMin, c.LargeAppendMax)
	case c.ThinkMax < c.ThinkMin || c.LongThinkMax < c.LongThinkMin || c.ThinkMin < 0 || c.ArrivalSpan < 0 || c.ArrivalSpacing < 0:
		return fmt.Errorf("time ranges invalid")
	case c.EditProb < 0 || c.EditProb > 1 || c.EditStripProb < 0 || c.EditStripProb > 1:
		return fmt.Errorf("edit probabilities must be in [0, 1]")
	case c.SharedPrompts < 0 || c.SharedPrompts > 1_000_000:
		return fmt.Errorf("shared prompts must be in [0, 1000000], got %d", c.SharedPrompts)
	case c.SharedPrompts > 0 && (c.SharedPromptMin < 1 || c.SharedPromptMax < c.SharedPromptMin || c.SharedPromptMax > c.InitialMin):
		return fmt.Errorf("shared prompt range [%d, %d] invalid (at most the smallest first-turn context %d)", c.SharedPromptMin, c.SharedPromptMax, c.InitialMin)
	}
	return nil
}

// Agentic generates the built-in workload; the same config always yields the same workload.
func Agentic(c AgenticConfig) (*Workload, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(c.Seed, 0x6b7663))
	uniDur := func(a, b time.Duration) time.Duration {
		if b <= a {
			return a
		}
		return a + time.Duration(rng.Int64N(int64(b-a)))
	}
	starts := make([]time.Duration, c.Sessions)
	for i := range starts {
		starts[i] = uniDur(0, c.ArrivalSpan)
	}
	sort.Slice(starts, func(i, j int) bool { return starts[i] < starts[j] })
	if c.ArrivalSpacing > 0 { // evenly spaced (the draws above still happen: the rest is the same)
		for i := range starts {
			starts[i] = time.Duration(i) * c.ArrivalSpacing
		}
	}
	w := &Workload{Name: "builtin-agentic"}
	// Edits and shared prompts draw from their own stream: the rest of the workload is the
	// same with or without them.
	erng := rand.New(rand.NewPCG(c.Seed, 0x65646974))
	shared := make([]int64, c.SharedPrompts)
	for g := range shared {
		shared[g] = c.SharedPromptMin + erng.Int64N(c.SharedPromptMax-c.SharedPromptMin+1)
	}
	for i := 0; i < c.Sessions; i++ {
		s := Session{ID: fmt.Sprintf("agent-%d-%04d", c.Seed, i), Start: starts[i]}
		if len(shared) > 0 {
			g := i % len(shared)
			s.SharedGroup, s.SharedPrefix = fmt.Sprintf("system-%d-%d", c.Seed, g), shared[g]
		}
		n := c.MinTurns + rng.IntN(c.MaxTurns-c.MinTurns+1)
		lo, hi := math.Log(float64(c.InitialMin)), math.Log(float64(c.InitialMax))
		input := int64(math.Exp(lo + rng.Float64()*(hi-lo)))
		for k := 0; k < n; k++ {
			t := Turn{}
			if k > 0 {
				prev := s.Turns[k-1]
				var app int64
				if rng.Float64() < c.LargeAppendProb {
					app = c.LargeAppendMin + rng.Int64N(c.LargeAppendMax-c.LargeAppendMin+1)
				} else {
					app = int64(math.Round(rng.ExpFloat64() * c.AppendMean))
					app = min(max(app, 16), 4096)
				}
				ctx := prev.InputTokens + prev.OutputTokens
				if erng.Float64() < c.EditProb {
					t.Edit = editOf(erng, c, s.SharedPrefix, prev)
					ctx += t.Edit.Insert - t.Edit.Remove
				}
				input = ctx + app
				t.Think = uniDur(c.ThinkMin, c.ThinkMax)
				if rng.Float64() < c.LongThinkProb {
					t.Think = uniDur(c.LongThinkMin, c.LongThinkMax)
				}
			}
			t.InputTokens = input
			t.OutputTokens = min(max(int64(math.Round(rng.ExpFloat64()*c.OutputMean)), 8), c.OutputMax)
			s.Turns = append(s.Turns, t)
		}
		w.Sessions = append(w.Sessions, s)
	}
	return w, nil
}

// editOf draws a history edit of the context before a turn whose previous turn is prev; the
// shared prefix (system prompt) is never edited.
func editOf(rng *rand.Rand, c AgenticConfig, shared int64, prev Turn) *Edit {
	if rng.Float64() < c.EditStripProb || prev.InputTokens <= shared+64 {
		// The reasoning of the last answer: its first half.
		return &Edit{Kind: EditStripReasoning, At: prev.InputTokens, Remove: max(1, prev.OutputTokens/2)}
	}
	// Compaction: a span of old turns (after the system prompt, in the first half of the
	// context) becomes a summary a tenth of its size.
	lo, hi := shared, shared+(prev.InputTokens-shared)/2
	at := lo + rng.Int64N(max(1, hi-lo))
	remove := max(16, (prev.InputTokens-at)*int64(30+rng.IntN(31))/100)
	return &Edit{Kind: EditCompaction, At: at, Remove: remove, Insert: max(1, remove/10)}
}

// Limit keeps at most n requests: whole sessions in start order, the last one cut short.
func (w *Workload) Limit(n int) {
	if n <= 0 {
		return
	}
	left := n
	var out []Session
	for _, s := range w.Sessions {
		if left == 0 {
			break
		}
		if len(s.Turns) > left {
			s.Turns = s.Turns[:left]
		}
		left -= len(s.Turns)
		out = append(out, s)
	}
	w.Sessions = out
}

// MultiTurnOnly drops single-turn sessions and shifts every time so that the first remaining
// session starts at 0 (a trace subset that exercises session residency).
func (w *Workload) MultiTurnOnly() {
	var out []Session
	for _, s := range w.Sessions {
		if len(s.Turns) > 1 {
			out = append(out, s)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Start < out[j].Start })
	if len(out) > 0 {
		base := out[0].Start
		for i := range out {
			out[i].Start -= base
			turns := append([]Turn(nil), out[i].Turns...)
			for k := range turns {
				if turns[k].At >= base {
					turns[k].At -= base
				}
			}
			out[i].Turns = turns
		}
	}
	w.Sessions = out
	w.Notes = append(w.Notes, fmt.Sprintf("multi-turn sessions only: %d sessions, %d requests, times shifted to start at 0", len(out), w.Requests()))
}
