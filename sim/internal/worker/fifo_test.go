package worker

import "testing"

func isHead(t *fifoTicket) bool {
	select {
	case <-t.head:
		return true
	default:
		return false
	}
}

func TestFIFOQueue(t *testing.T) {
	var q fifoQueue
	a, b, c := q.join(), q.join(), q.join()
	if !isHead(a) || isHead(b) || isHead(c) || q.len() != 3 {
		t.Fatalf("after joins: a %v b %v c %v len %d", isHead(a), isHead(b), isHead(c), q.len())
	}
	q.leave(c) // a waiter that gives up (deadline) does not promote anyone
	if isHead(b) || q.len() != 2 {
		t.Fatal("leaving from the tail promoted b")
	}
	q.leave(a)
	if !isHead(b) {
		t.Fatal("b is not the head after a left")
	}
	d := q.join()
	if isHead(d) {
		t.Fatal("a late arrival jumped the queue")
	}
	q.leave(b)
	if !isHead(d) || q.len() != 1 {
		t.Fatal("d is not the head")
	}
	q.leave(d)
	q.leave(d) // twice: no-op
	if e := q.join(); !isHead(e) {
		t.Fatal("empty queue: not the head at once")
	}
}
