package workload

import (
	"reflect"
	"testing"
	"time"
)

func TestAgenticDeterministicAndShaped(t *testing.T) {
	c := DefaultAgentic()
	a, err := Agentic(c)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Agentic(c)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same seed, different workloads")
	}
	c.Seed = 2
	other, _ := Agentic(c)
	if reflect.DeepEqual(a, other) {
		t.Fatal("different seeds, same workload")
	}
	st := a.Describe()
	if st.Sessions != 10 || st.Requests < 140 || st.Requests > 260 {
		t.Fatalf("size %+v", st)
	}
	// The seeds' shape: small appends (mean ~341) on contexts of tens of thousands of tokens.
	if st.MeanAppend < 250 || st.MeanAppend > 500 || st.MaxInput < 20000 {
		t.Fatalf("shape %+v", st)
	}
	large := 0
	for _, s := range a.Sessions {
		for i := 1; i < len(s.Turns); i++ {
			p, cur := s.Turns[i-1], s.Turns[i]
			if cur.Edit != nil {
				continue // edited history: TestEditsAndSharedPrompts
			}
			if cur.InputTokens <= p.InputTokens+p.OutputTokens || cur.Think <= 0 {
				t.Fatalf("session %s turn %d does not extend the previous: %+v -> %+v", s.ID, i, p, cur)
			}
			if cur.InputTokens-p.InputTokens-p.OutputTokens > 8192 {
				large++
			}
		}
	}
	// The demo exercises real large appends (above the 8,192-token direct-to-D limit).
	if large < 1 || large > 5 {
		t.Fatalf("%d appends above the direct-to-D limit, want 1-5", large)
	}
}

func TestAgenticValidate(t *testing.T) {
	tests := []struct {
		name string
		mut  func(*AgenticConfig)
	}{
		{"no sessions", func(c *AgenticConfig) { c.Sessions = 0 }},
		{"turns", func(c *AgenticConfig) { c.MaxTurns = c.MinTurns - 1 }},
		{"initial", func(c *AgenticConfig) { c.InitialMin = 0 }},
		{"prob", func(c *AgenticConfig) { c.LongThinkProb = 2 }},
		{"large append empty", func(c *AgenticConfig) { c.LargeAppendMax = c.LargeAppendMin - 1 }},
		{"spacing", func(c *AgenticConfig) { c.ArrivalSpacing = -time.Second }},
		{"large append zero", func(c *AgenticConfig) { c.LargeAppendMin, c.LargeAppendMax = 0, 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultAgentic()
			tt.mut(&c)
			if _, err := Agentic(c); err == nil {
				t.Fatal("accepted")
			}
		})
	}
}

// A fixed large append (min = max) is exactly that size on every turn that draws one.
func TestFixedLargeAppend(t *testing.T) {
	c := DefaultAgentic()
	c.Sessions, c.MinTurns, c.MaxTurns, c.LargeAppendProb, c.EditProb = 4, 3, 3, 1, 0
	c.LargeAppendMin, c.LargeAppendMax = 9216, 9216
	c.ArrivalSpacing = 7 * time.Second
	w, err := Agentic(c)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range w.Sessions {
		if s.Start != time.Duration(i)*7*time.Second {
			t.Errorf("%s starts at %v, want %v", s.ID, s.Start, time.Duration(i)*7*time.Second)
		}
		for k := 1; k < len(s.Turns); k++ {
			prev, cur := s.Turns[k-1], s.Turns[k]
			if got := cur.InputTokens - prev.InputTokens - prev.OutputTokens; got != 9216 {
				t.Errorf("%s turn %d appends %d, want 9216", s.ID, k, got)
			}
		}
	}
}

func TestLimit(t *testing.T) {
	w := &Workload{Sessions: []Session{{ID: "a", Turns: make([]Turn, 3)}, {ID: "b", Turns: make([]Turn, 3)}, {ID: "c", Turns: make([]Turn, 3)}}}
	w.Limit(4)
	if w.Requests() != 4 || len(w.Sessions) != 2 || len(w.Sessions[1].Turns) != 1 {
		t.Fatalf("%+v", w)
	}
}

func TestMultiTurnOnly(t *testing.T) {
	w := &Workload{Sessions: []Session{
		{ID: "single", Start: 1 * time.Second, Turns: []Turn{{At: time.Second}}},
		{ID: "multi", Start: 5 * time.Second, Turns: []Turn{{At: 5 * time.Second}, {At: 9 * time.Second}}},
	}}
	w.MultiTurnOnly()
	if len(w.Sessions) != 1 || w.Sessions[0].ID != "multi" || w.Sessions[0].Start != 0 || w.Sessions[0].Turns[1].At != 4*time.Second {
		t.Fatalf("%+v", w.Sessions)
	}
}
