import sys, collections
for path in sys.argv[1:]:
    tot=0; self_=collections.Counter(); incl=collections.Counter(); threads=collections.Counter()
    for line in open(path):
        line=line.rstrip()
        if not line: continue
        stack, _, n = line.rpartition(' ')
        n=int(n); tot+=n
        frames=stack.split(';')
        threads[frames[0]]+=n
        self_[frames[-1]]+=n
        for f in set(frames[1:]): incl[f]+=n
    print('==', path, 'samples', tot)
    print(' threads:', threads.most_common(6))
    print(' self:'); [print(f'   {c/tot:6.1%} {f[:150]}') for f,c in self_.most_common(14)]
    print(' inclusive:'); [print(f'   {c/tot:6.1%} {f[:150]}') for f,c in incl.most_common(25)]
