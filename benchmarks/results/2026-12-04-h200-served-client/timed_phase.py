import json, sys, statistics
def phase(path):
    t=json.load(open(path)); rows=t['rows']
    # split at the largest gap between steps
    gaps=[(rows[i+1][0]-(rows[i][0]+rows[i][1]), i) for i in range(len(rows)-1)]
    g,i=max(gaps)
    r=rows[i+1:]
    span=r[-1][0]+r[-1][1]-r[0][0]; busy=sum(x[1] for x in r)
    pre=[x for x in r if x[2]]
    dec=[x for x in r if not x[2]]
    return dict(gap_s=round(g,2), steps=len(r), span_s=round(span,3), busy_frac=round(busy/span,3),
        mean_running=round(sum(x[1]*x[6] for x in r)/busy,1), emitted=sum(x[5] for x in r),
        prefill_steps=len(pre), prefill_s=round(sum(x[1] for x in pre),3), prefill_tokens_mean=round(statistics.mean(x[2] for x in pre),1) if pre else 0,
        decode_steps=len(dec), decode_s=round(sum(x[1] for x in dec),3), rounds=sum(x[4] for x in r),
        decode_rounds_per_launch=round(statistics.mean(x[4] for x in dec),2) if dec else 0)
for p in sys.argv[1:]:
    print(p.split('/')[-2], phase(p))
