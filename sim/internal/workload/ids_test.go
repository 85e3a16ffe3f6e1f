package workload

import (
	"testing"
)

// TestEditsAndSharedPrompts: the built-in workload edits the history of about EditProb of
// its continuing turns (both kinds), never inside the shared system prompt, and its sessions
// share system prompts; ContextIDs carries both into the ids a client sends.
func TestEditsAndSharedPrompts(t *testing.T) {
	c := DefaultAgentic()
	c.Sessions = 60
	w, err := Agentic(c)
	if err != nil {
		t.Fatal(err)
	}
	st := w.Describe()
	continuing := st.Requests - st.Sessions
	if rate := float64(st.EditedTurns) / float64(continuing); rate < 0.02 || rate > 0.07 {
		t.Fatalf("%d of %d continuing turns edited (%.1f%%), want about %.0f%%", st.EditedTurns, continuing, 100*rate, 100*c.EditProb)
	}
	if st.SharedPromptSessions != c.Sessions {
		t.Fatalf("%d sessions share a system prompt, want %d", st.SharedPromptSessions, c.Sessions)
	}
	kinds := map[string]int{}
	for _, s := range w.Sessions {
		var hist []int64
		for k, tu := range s.Turns {
			ids := s.ContextIDs(hist, k, 1000)
			if int64(len(ids)) != tu.InputTokens {
				t.Fatalf("%s turn %d: %d ids, input %d", s.ID, k, len(ids), tu.InputTokens)
			}
			if e := tu.Edit; e != nil {
				kinds[e.Kind]++
				if e.At < s.SharedPrefix {
					t.Fatalf("%s turn %d: edit at %d inside the shared prompt (%d)", s.ID, k, e.At, s.SharedPrefix)
				}
				// The context diverges from the history exactly at the edit.
				for i := int64(0); i < e.At; i++ {
					if ids[i] != hist[i] {
						t.Fatalf("%s turn %d: id %d changed before the edit at %d", s.ID, k, i, e.At)
					}
				}
				same := true
				for i := e.At; i < min(int64(len(hist)), int64(len(ids))); i++ {
					if ids[i] != hist[i] {
						same = false
						break
					}
				}
				if same {
					t.Fatalf("%s turn %d: the edit at %d changed nothing", s.ID, k, e.At)
				}
			} else if k > 0 {
				for i := range hist {
					if ids[i] != hist[i] {
						t.Fatalf("%s turn %d: unedited turn changed id %d", s.ID, k, i)
					}
				}
			}
			out := make([]int64, tu.OutputTokens)
			for i := range out {
				out[i] = int64(7000 + k*100 + i)
			}
			hist = append(ids, out...)
		}
	}
	if kinds[EditStripReasoning] == 0 || kinds[EditCompaction] == 0 {
		t.Fatalf("edit kinds %v, want both", kinds)
	}
	// Sessions of one group begin with the same ids; of different groups, not.
	a, b, other := &w.Sessions[0], &w.Sessions[c.SharedPrompts], &w.Sessions[1]
	ia, ib, io := a.ContextIDs(nil, 0, 1000), b.ContextIDs(nil, 0, 1000), other.ContextIDs(nil, 0, 1000)
	for i := int64(0); i < a.SharedPrefix; i++ {
		if ia[i] != ib[i] {
			t.Fatalf("sessions of group %s differ at %d", a.SharedGroup, i)
		}
	}
	if ia[a.SharedPrefix] == ib[a.SharedPrefix] && ia[a.SharedPrefix+1] == ib[a.SharedPrefix+1] {
		t.Fatal("sessions share more than the system prompt")
	}
	diff := 0
	for i := 0; i < 64; i++ {
		if ia[i] != io[i] {
			diff++
		}
	}
	if diff == 0 {
		t.Fatal("different groups share a system prompt")
	}
	// Without edits and shared prompts the workload's lengths are unchanged.
	c2 := DefaultAgentic()
	c2.EditProb, c2.SharedPrompts = 0, 0
	plain, _ := Agentic(c2)
	base, _ := Agentic(DefaultAgentic())
	for i := range plain.Sessions {
		if plain.Sessions[i].Turns[0].InputTokens != base.Sessions[i].Turns[0].InputTokens {
			t.Fatal("edits or shared prompts changed the first turns")
		}
	}
}
